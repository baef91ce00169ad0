"""Checkpoints of applied models: `planc.save` (sharded, torch.distributed.checkpoint), `fill_from_dcp`
(its read side, resharding into a model sharded under any plan), `planc.export` (hub-layout safetensors),
and the guards that keep `save_pretrained` and `copy.deepcopy` from silently doing the wrong thing.

One module per concept: `atomic` (write beside, rename on success), `marker` (the `planc.json` that
says what plan a checkpoint was saved under), `state` (the tensors DCP sees), `save`, `dcp`, `export`,
`guards`.
"""
