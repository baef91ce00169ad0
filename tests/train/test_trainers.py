"""transformers' Trainer, TRL's SFTTrainer and an Accelerate loop on planc models, on 2 gloo ranks.

planc.apply / planc.load describe the model as transformers describes one it sharded itself
(planc.runtime.trainers), so these clients take it without a second wrap and train it with the plan's data
parallelism: 3 optimizer steps of 2 accumulated micro-batches with max_grad_norm equal the unsharded model
trained in one process on the same global batches (SFTTrainer too, with `bf16=False`: SFTConfig defaults to
bf16 autocast, which TrainingArguments does not); 2 Trainer steps, planc.save, planc.load + load_optimizer and 2 more steps
equal 4 uninterrupted ones (a linear LR schedule over the 4, its state saved beside); Trainer's own checkpoints
(save_strategy, save_only_model, resume_from_checkpoint) are refused on every rank, upstream or by planc naming
planc's recipe. PEFT LoRA (get_peft_model after planc.load, then planc.distribute_adapters) through
Trainer at tp 1 (replicate, fsdp) and Accelerate at tp 2 (DeepSeek-V3 in bf16) trains only the adapters, equal on
every rank and to the unsharded LoRA run, and save_pretrained writes the unsharded run's adapter file
(tests/train/lora_workers.py; tp 2 with dp 2 runs in the 4-rank world of test_data_parallel.py); undistributed
adapters, LoRA on routed experts, lora_dropout on colwise TP layers and planc.apply on a PeftModel are refused,
each saying what to do instead. One spawned world runs every case (a rank's start costs more than a case);
the full grid (3 families x (tp, ep, dp) x fsdp/replicate x client, 2 and 4 ranks) is
`python -m tests.train.trainers_grid`.

On CPU, Trainer refuses tp > 1 upstream: transformers hands accelerate a ParallelismConfig(tp_size=...), and
accelerate's ParallelismConfig._validate_accelerator accepts it only under FSDP2, a multi-device launch or
DeepSpeed ("ParallelismConfig is only compatible DistributedType.FSDP (version 2) or
DistributedType.Multi{Device} or DistributedType.DEEPSPEED, but got DistributedType.MULTI_CPU"). The
Accelerate loop covers tp 2 here.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.train.lora_workers import lora_failures
from tests.train.train_workers import PARAM_TOL, reference_failures
from tests.train.trainers_workers import LORA_CASES, trainers_world


# (model, tp, ep, dp, data_parallel, client): every family, both modes, both clients, tp 1 and tp 2
CI_CASES = [
    ("mixtral", 1, 2, 2, "fsdp", "trainer"),
    ("deepseek_v3", 1, 2, 2, "replicate", "trainer"),
    ("qwen3_moe", 2, 2, 1, "fsdp", "accelerate"),
    ("deepseek_v3", 2, 2, 1, "replicate", "accelerate"),
    ("qwen3_moe", 1, 2, 2, "fsdp", "sft"),
]


# what each LoRA refusal must say: the call that fixes it, the targets to use, the setting to change, the order
LORA_REFUSALS = {"undistributed": "planc.distribute_adapters(model)", "experts": 'target_modules=["q_proj"',
                 "dropout": "use lora_dropout=0.0", "apply_on_peft": "then call peft's get_peft_model",
                 "style": "`mla_kv_a_proj`, which LoRA adapters cannot follow"}


def failures(cases: list, results: list) -> list[str]:
    out = []
    for case in cases:
        per_rank = [r[case] for r in results]
        first = per_rank[0]
        if "error" in first:
            out.append(f"{case}: {first['error']}")
            continue
        tp, dp = case[1], case[3]
        if first["described"] != (True, tp, dp):
            out.append(f"{case}: described to transformers as {first['described']}")
        if first["wrapped_by"] is not None:
            out.append(f"{case}: wrapped again by {first['wrapped_by']}")
        if first["steps"] != 3:
            out.append(f"{case}: {first['steps']} optimizer steps logged")
        out += reference_failures(case, per_rank)
    return out


@pytest.mark.distributed
def test_trainer_and_accelerate_train_planc_models_as_the_unsharded_model():
    results = run_distributed(trainers_world, 2, CI_CASES)
    problems = failures(CI_CASES, results) + lora_failures(LORA_CASES, results)
    for rank, r in enumerate(results):
        refused = r["refusals"]
        if "ParallelismConfig is only compatible" not in refused["tp"]:
            problems.append(f"rank {rank}: Trainer at tp 2 on CPU: {refused['tp']}")
        if "Resuming is not supported for models sharded at load time" not in refused["save_strategy"]:
            problems.append(f"rank {rank}: save_strategy='steps': {refused['save_strategy']}")
        if "planc.save(model, dir)" not in refused["save_model"] or refused["save_model_wrote"]:
            problems.append(f"rank {rank}: save_model: {refused['save_model']} wrote {refused['save_model_wrote']}")
        if "planc.save(model, dir, optimizer=trainer.optimizer)" not in refused["save_only_model"]:
            problems.append(f"rank {rank}: save_strategy='steps', save_only_model=True: {refused['save_only_model']}")
        if "Can't find a valid checkpoint" not in r["resume"]["trainer_resume"]:
            problems.append(f"rank {rank}: Trainer resume_from_checkpoint=<planc checkpoint>: "
                            f"{r['resume']['trainer_resume']}")
        for name, message in r["lora"]["refusals"].items():
            if "ApplyError" not in message or LORA_REFUSALS[name] not in message:
                problems.append(f"rank {rank}: LoRA {name}: {message}")
        if r["resume"]["params"] > PARAM_TOL:
            problems.append(f"rank {rank}: Trainer resumed through planc.save/load_optimizer is off by "
                            f"{r['resume']['params']:.3g} from the uninterrupted run")
    assert not problems, "\n".join(problems)
