"""Checkpoints at real scale: `load` (meta build, sliced safetensors reads), `save` (DCP), `export` (hub layout).

One module per concept: `files`, `keys`, `load` (planc.load); `atomic` (write beside, rename on
success), `marker` (the `planc.json` that says what plan a checkpoint was saved under), `state` (the
tensors DCP sees), `save`, `optimizer` (optimizer state beside the model: `planc.save(optimizer=)`,
`planc.load_optimizer`), `dcp` (`fill_from_dcp`, planc.save's read side, resharding into a model
sharded under any plan), `export`. What an applied model refuses (save_pretrained, copy.deepcopy)
is planc.runtime.guards, set by install.
"""
