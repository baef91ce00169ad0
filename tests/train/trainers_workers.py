"""Rank code of the trainer-integration tests: one spawned world runs every (model, layout, mode, client) case.

Each case: a tiny fp32 model planc-applied at (tp, ep, dp) with `training.data_parallel`, trained 3 optimizer
steps of 2 accumulated micro-batches with gradient clipping by a real client (transformers' Trainer, TRL's
SFTTrainer, an Accelerate loop), against the unsharded model trained in this process on the same global
batches (computed once per model and dp): one process on the global batch is every client's peer, TRL's
SFTTrainer's too (fp32: SFTConfig's bf16 default turned off).
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from tests.runtime.workers import full, shipped_plan
from tests.train.lora_workers import lora_world
from tests.train.train_workers import (  # the reference's step and the batches, shared
    ACCUM, COLS, LR, MAX_NORM, MICRO_ROWS, STEPS, VOCAB, compare_params, error_of, rows, step_rows, unsharded_run)


_REFERENCE: dict = {}


def reference(model_type: str, dp: int) -> dict:
    """The unsharded model trained on each step's global batch (every micro-batch of every replica at once)."""
    key = (model_type, dp)
    if key not in _REFERENCE:  # Trainer's default AdamW has no weight decay
        _REFERENCE[key] = unsharded_run(model_type, 0, [step_rows(dp, step) for step in range(STEPS)], weight_decay=0.0)
    return _REFERENCE[key]


def planc_model(model_type: str, tp: int, ep: int, dp: int, mode: str):
    import planc
    from planc.models.build import build_tiny_model

    model = build_tiny_model(model_type, seed=0)
    plan = shipped_plan(model_type, tp=tp, ep=ep, dp=dp, ep_implementation="all_to_all")
    plan["training"] = {"data_parallel": mode}
    planc.apply(model, plan)
    return model


def dataset(dp: int):
    from datasets import Dataset

    ids = rows(dp).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def trainer_args(output_dir: str, **extra) -> dict:
    """TrainingArguments (SFTConfig) of every Trainer case: constant lr, plain AdamW, the data in order."""
    return dict(
        output_dir=output_dir, per_device_train_batch_size=MICRO_ROWS, gradient_accumulation_steps=ACCUM,
        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", optim="adamw_torch", weight_decay=0.0,
        max_grad_norm=MAX_NORM, train_sampling_strategy="sequential", logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, **extra)


def run_trainer(model, dp: int, output_dir: str) -> tuple[list, list, object]:
    """transformers' Trainer as users run it; the logged per-step losses and gradient norms."""
    from transformers import Trainer, TrainingArguments

    trainer = Trainer(model=model, args=TrainingArguments(**trainer_args(output_dir)), train_dataset=dataset(dp))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return [h["loss"] for h in logs], [h["grad_norm"] for h in logs], trainer.model_wrapped


def tokenizer():
    """A word-level tokenizer over the tiny models' vocabulary (TRL's SFTTrainer asks for one: its pad token)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                   pad_token="<pad>", eos_token="</s>", bos_token="<s>")


def run_sft(model, dp: int, output_dir: str) -> tuple[list, list, object]:
    """TRL's SFTTrainer on a tokenized dataset (input_ids only: SFTTrainer builds the labels)."""
    from trl import SFTConfig, SFTTrainer

    # the reference has no router aux loss (the tiny configs do not output router logits); TRL would turn it on.
    # SFTConfig defaults to bf16=True (autocast) where TrainingArguments does not: the fp32 reference needs fp32
    config = SFTConfig(**trainer_args(output_dir), router_aux_loss_coef=0.0, bf16=False)
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset(dp).remove_columns("labels"),
                         processing_class=tokenizer())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return [h["loss"] for h in logs], [h["grad_norm"] for h in logs], trainer.model_wrapped


def run_accelerate(model, dp: int) -> tuple[list, list, object]:
    """Accelerate's loop: prepare (the model as Trainer prepares a model sharded at load time), accumulate,
    backward, clip_grad_norm_, step; each dp replica reads its micro-batches (TP ranks read the same ones)."""
    import planc
    from accelerate import Accelerator

    # accelerate's state is process-wide: an explicit "no" refuses to run under another client's bf16 left behind
    acc = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True, mixed_precision="no")
    model = acc.prepare_model(model, evaluation_mode=True)
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0))
    dp_rank = planc.device_mesh(model, "dp").get_local_rank()
    batches = rows(dp).split(MICRO_ROWS)[dp_rank::dp]  # micro-batch i of the run: replica i % dp
    model.train()
    losses, norms, window = [], [], []
    for batch in batches:
        with acc.accumulate(model):
            loss = model(batch, labels=batch).loss
            acc.backward(loss)
            window.append(loss.detach())
            if acc.sync_gradients:
                norms.append(acc.clip_grad_norm_(model.parameters(), MAX_NORM).item())
            opt.step()
            opt.zero_grad()
        if acc.sync_gradients:
            mean = torch.stack(window).mean()
            losses.append(acc.reduce(mean, reduction="mean").item())  # TP ranks hold their replica's loss
            window = []
    return losses, norms, model


CLIENTS = {"trainer": run_trainer, "sft": run_sft}


def client_case(model_type: str, tp: int, ep: int, dp: int, mode: str, client: str) -> dict:
    """Worst loss / grad-norm / parameter difference against the unsharded reference, and what wraps the model."""
    ref = reference(model_type, dp)
    model = planc_model(model_type, tp, ep, dp, mode)
    described = (model.is_distributed_loading_by_transformers, model.tp_size, model.config.distributed_config.dp_size)
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = os.path.join(tmp, "out")
        if client == "accelerate":
            losses, norms, wrapped = run_accelerate(model, dp)
        else:
            losses, norms, wrapped = CLIENTS[client](model, dp, out_dir)
    out = {"wrapped_by": type(wrapped).__name__ if wrapped is not model else None, "steps": len(losses),
           "described": described,
           "loss": max((abs(a - b) for a, b in zip(losses, ref["losses"])), default=float("inf")),
           "norm_rel": max((abs(a - b) / b for a, b in zip(norms, ref["norms"])), default=float("inf"))}
    out["params"], out["worst"], out["digest"] = compare_params(model, ref["params"])
    return out


def resume_check(rank: int, world_size: int, mode: str = "fsdp") -> dict:
    """Trainer for 2 steps, planc.save (model + optimizer) and the LR scheduler's state, planc.load + load_optimizer
    and the scheduler's state, Trainer for 2 more steps: equal to 4 uninterrupted steps. The optimizer and a linear
    schedule over the 4 steps are the user's, handed to Trainer (`optimizers=`)."""
    import planc
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments, get_linear_schedule_with_warmup

    dp = world_size
    per_step = ACCUM * dp * MICRO_ROWS
    ids = torch.randint(3, VOCAB, (4 * per_step, COLS), generator=torch.Generator().manual_seed(5))
    plan = shipped_plan("mixtral", tp=1, ep=world_size, dp=dp, ep_implementation="all_to_all")
    plan["training"] = {"data_parallel": mode}

    def train(model, first: int, steps: int, tmp: str):
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        schedule = get_linear_schedule_with_warmup(opt, 0, 4)  # over the whole run
        return opt, schedule, lambda: Trainer(
            model=model, optimizers=(opt, schedule),
            args=TrainingArguments(**{**trainer_args(os.path.join(tmp, "out")), "max_steps": steps}),
            train_dataset=Dataset.from_dict({"input_ids": ids[first * per_step:(first + steps) * per_step].tolist(),
                                             "labels": ids[first * per_step:(first + steps) * per_step].tolist()}),
        ).train()

    with tempfile.TemporaryDirectory() as tmp0:
        tmp = [tmp0]
        dist.broadcast_object_list(tmp)  # one checkpoint dir for every rank
        whole = planc_model("mixtral", 1, world_size, dp, mode)
        _, _, run = train(whole, 0, 4, tmp[0])
        run()
        first = planc_model("mixtral", 1, world_size, dp, mode)
        opt, schedule, run = train(first, 0, 2, tmp[0])
        run()
        ckpt = os.path.join(tmp[0], "ckpt")
        planc.save(first, ckpt, optimizer=opt)
        if rank == 0:
            torch.save(schedule.state_dict(), os.path.join(ckpt, "scheduler.pt"))
        dist.barrier()
        resumed = planc.load(ckpt, plan)
        opt, schedule, run = train(resumed, 2, 2, tmp[0])
        # Trainer's own resume reads hub-layout weights only (upstream): refused before anything is read
        refused = error_of(lambda: Trainer(model=resumed, args=TrainingArguments(**trainer_args(tmp[0])),
                                         train_dataset=dataset(dp)).train(resume_from_checkpoint=ckpt))
        planc.load_optimizer(resumed, opt, ckpt)
        schedule.load_state_dict(torch.load(os.path.join(ckpt, "scheduler.pt")))
        run()
        mine = dict(resumed.named_parameters())
        diff = max((full(p.detach()) - full(mine[n].detach())).abs().max().item() for n, p in whole.named_parameters())
        dist.barrier()
    return {"params": diff, "trainer_resume": refused}


def refusals(rank: int, world_size: int) -> dict:
    """What Trainer refuses on a planc model, on every rank: tp > 1 on CPU (accelerate's ParallelismConfig check),
    its own checkpoints (save_strategy: upstream when Trainer is built; with save_only_model=True planc's
    save_pretrained guard at the first checkpoint), save_model (the guard, nothing written)."""
    from transformers import Trainer, TrainingArguments

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        tp_model = planc_model("mixtral", world_size, world_size, 1, "fsdp")
        out["tp"] = error_of(lambda: Trainer(model=tp_model, args=TrainingArguments(**trainer_args(tmp)),
                                           train_dataset=dataset(1)).train())
        model = planc_model("mixtral", 1, world_size, world_size, "fsdp")
        steps = {**trainer_args(tmp), "save_strategy": "steps", "save_steps": 1}
        out["save_strategy"] = error_of(lambda: Trainer(model=model, args=TrainingArguments(**steps),
                                                      train_dataset=dataset(world_size)))
        only_model = {**steps, "save_only_model": True, "max_steps": 1}  # the check above lets it through
        out["save_only_model"] = error_of(lambda: Trainer(model=model, args=TrainingArguments(**only_model),
                                                        train_dataset=dataset(world_size)).train())
        trainer = Trainer(model=model, args=TrainingArguments(**trainer_args(tmp)), train_dataset=dataset(world_size))
        target = os.path.join(tmp, "saved")
        out["save_model"] = error_of(lambda: trainer.save_model(target))
        dist.barrier()
        out["save_model_wrote"] = sorted(os.listdir(target)) if os.path.isdir(target) else []
    return out


# (model, tp, ep, dp, data_parallel, client, dtype): PEFT LoRA (tests/train/lora_workers.py) through Trainer at tp 1,
# and at tp 2 through Accelerate (Trainer refuses tp > 1 on CPU), DeepSeek-V3 in bf16
LORA_CASES = [("mixtral", 1, 2, 2, "replicate", "trainer", "float32"),
              ("qwen3_moe", 1, 2, 2, "fsdp", "trainer", "float32"),
              ("deepseek_v3", 2, 2, 1, "replicate", "accelerate", "bfloat16")]


def trainers_world(rank: int, world_size: int, cases: list, extras: bool = True) -> dict:
    """Every case in this one world; `extras`: Trainer's refusals, resume, the LoRA cases and refusals (test_trainers.py)."""
    import transformers

    transformers.logging.set_verbosity_error()
    out = {}
    for case in cases:
        try:
            out[case] = client_case(*case)
        except Exception as e:  # noqa: BLE001 - reported per case by the test, with its traceback's last line
            out[case] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        dist.barrier()
    if extras:
        out["refusals"] = refusals(rank, world_size)
        out["resume"] = resume_check(rank, world_size)
        out["lora"] = lora_world(rank, world_size, LORA_CASES, refusals=True)
    return out
