"""Rank code for the optimizer-state tests (module level: spawn pickles functions by name).

A training run of each family is loaded by `planc.load` from a `save_pretrained` directory, trained with AdamW
(steps 1-4, one batch per step, the same on every rank), and saved with its optimizer after step 2. A resumed run
is `planc.load` of that checkpoint at other sizes, a fresh AdamW, `planc.load_optimizer`, then steps 3 and 4.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from tests.runtime.workers import FOUR_RANK_HEADS, batch, shipped_plan

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
# case -> family; `mixtral-packed`: experts tensor-parallel (`packed_colwise` gate_up, a `_StridedShard`, whose
# AdamW states are strided too and go through DCP as the plain `Shard`)
CASES = {**{f: f for f in FAMILIES}, "mixtral-packed": "mixtral", "mixtral-grouped": "mixtral"}
# `-grouped`: a decay / no-decay AdamW (norms undecayed, at half the lr); resumed into one built with other values
GROUPED = "mixtral-grouped"
STEPS = 4
SAVE_AFTER = 2
LR = 1e-2
SAVED_GROUPS = ((0.1, LR), (0.0, LR / 2))  # (weight_decay, lr) of GROUPED's decay and no-decay group


def write_hub_checkpoints(root: Path) -> None:
    """root/<family>/hub: the tiny model as `save_pretrained` writes it (fp32)."""
    from planc.models.build import build_tiny_model

    for family in FAMILIES:
        build_tiny_model(family, seed=1, **FOUR_RANK_HEADS.get(family, {})).save_pretrained(root / family / "hub")


# Resumed at 4 ranks with data parallelism too: (tp, ep, dp) = (2, 2, 2) under each `training.data_parallel`
DP_CASES = {f"{family}@dp2-{mode}": (family, mode) for family in FAMILIES for mode in ("fsdp", "replicate")}
# ... and the fsdp run saved again after step 3, resumed at 1 rank for step 4
RESAVED = "mixtral@dp2-fsdp"


def plan(case: str, world: int) -> dict:
    """The shipped plan of the case's family at tp = ep = world; `-packed`: its experts tensor-parallel;
    a DP_CASES one at (2, 2, 2) with its `training:` mode."""
    from tests.checkpoint.workers import plan_for

    if case in DP_CASES:
        family, mode = DP_CASES[case]
        return {**shipped_plan(family, tp=2, ep=2, dp=2), "training": {"data_parallel": mode}}
    if case.endswith("-packed"):
        return plan_for("packed", CASES[case], world)
    return shipped_plan(CASES[case], tp=world)


def optimizer_for(model, case: str = "", groups=SAVED_GROUPS, undecayed=("norm",)):
    """AdamW over every parameter; GROUPED: `groups` (weight_decay, lr) for the parameters named without /
    with one of `undecayed`."""
    if case != GROUPED:
        return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    named = list(model.named_parameters())
    split = [[p for n, p in named if not any(u in n for u in undecayed)],
             [p for n, p in named if any(u in n for u in undecayed)]]
    return torch.optim.AdamW([{"params": ps, "weight_decay": wd, "lr": lr} for ps, (wd, lr) in zip(split, groups)])


def step(model, optimizer, n: int) -> float:
    """Training step `n` (1-based): each dp replica its rows of the step's batch, backward, AdamW step; returns
    the loss of the whole batch (the mean over the replicas: their rows hold as many tokens)."""
    import planc

    dp = planc.device_mesh(model, "dp")
    model.train()
    ids = batch(100 + n)[dp.get_local_rank()::dp.size()]
    loss = model(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def train_and_save_world(rank, world_size, root):
    """The uninterrupted run of each family at `world_size` (losses of steps 1-4), saved with the optimizer after
    step 2 to root/<family>/ckpt (and without it to root/<family>/model_only)."""
    import planc

    out = {}
    for case, family in CASES.items():
        try:
            model = planc.load(Path(root) / family / "hub", plan(case, world_size))
            optimizer = optimizer_for(model, case)
            losses = []
            for n in range(1, STEPS + 1):
                losses.append(step(model, optimizer, n))
                if n == SAVE_AFTER:
                    planc.save(model, Path(root) / case / "ckpt", optimizer=optimizer)
                    if case == "mixtral":
                        planc.save(model, Path(root) / case / "model_only")
            out[case] = losses
        except Exception:  # noqa: BLE001 - every family reported
            out[case] = traceback.format_exc()
    return out


def _attempt(fn) -> str:
    try:
        fn()
        return "no error"
    except Exception as e:  # noqa: BLE001 - the tests read the type and message
        return f"{type(e).__name__}: {e}"


def resume_world(rank, world_size, root, bad_inputs: bool):
    """Each family's checkpoint loaded at `world_size`, its optimizer restored, steps 3-4; with `bad_inputs`, the
    refusals too (no optimizer state, another optimizer class, another parameter set, another model)."""
    import planc

    out = {}
    for case in CASES:
        try:
            ckpt = Path(root) / case / "ckpt"
            model = planc.load(ckpt, plan(case, world_size))
            # built with other hyperparameters: the resume gives each group back its own
            optimizer = optimizer_for(model, case, groups=((0.01, 1e-3), (0.01, 1e-3)))
            planc.load_optimizer(model, optimizer, ckpt)
            out[f"{case}/groups"] = [(g["weight_decay"], g["lr"]) for g in optimizer.param_groups]
            out[f"{case}/step"] = sorted({float(s["step"]) for s in optimizer.state.values()})
            out[case] = [step(model, optimizer, n) for n in range(SAVE_AFTER + 1, STEPS + 1)]
            if case == "mixtral":  # the control: a fresh optimizer (what planc.save alone gave) trains differently
                model = planc.load(ckpt, plan(case, world_size))
                optimizer = optimizer_for(model)
                out[f"{case}/fresh"] = [step(model, optimizer, n) for n in range(SAVE_AFTER + 1, STEPS + 1)]
        except Exception:  # noqa: BLE001
            out[case] = traceback.format_exc()
    if world_size == 4:
        for case, (family, _) in DP_CASES.items():
            try:
                ckpt = Path(root) / family / "ckpt"
                model = planc.load(ckpt, plan(case, world_size))
                optimizer = optimizer_for(model)
                planc.load_optimizer(model, optimizer, ckpt)
                out[case] = [step(model, optimizer, SAVE_AFTER + 1)]
                if case == RESAVED:
                    planc.save(model, Path(root) / case, optimizer=optimizer)
                out[case].append(step(model, optimizer, SAVE_AFTER + 2))
            except Exception:  # noqa: BLE001
                out[case] = traceback.format_exc()
    if world_size == 1:
        try:
            model = planc.load(Path(root) / RESAVED, plan(DP_CASES[RESAVED][0], 1))
            optimizer = optimizer_for(model)
            planc.load_optimizer(model, optimizer, Path(root) / RESAVED)
            out[RESAVED] = [step(model, optimizer, SAVE_AFTER + 2)]
        except Exception:  # noqa: BLE001
            out[RESAVED] = traceback.format_exc()
    if not bad_inputs:
        return out
    root = Path(root)
    model = planc.load(root / "mixtral" / "ckpt", plan("mixtral", world_size))
    out["bad/no_state"] = _attempt(lambda: planc.load_optimizer(model, optimizer_for(model), root / "mixtral" / "model_only"))
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    out["bad/class"] = _attempt(lambda: planc.load_optimizer(model, sgd, root / "mixtral" / "ckpt"))
    subset = torch.optim.AdamW([p for n, p in model.named_parameters() if "experts" not in n], lr=LR)
    out["bad/param_set"] = _attempt(lambda: planc.load_optimizer(model, subset, root / "mixtral" / "ckpt"))
    out["bad/param_set_state"] = len(subset.state)  # a refused load leaves no made-up state behind
    other = planc.load(root / "qwen3_moe" / "ckpt", plan("qwen3_moe", world_size))
    out["bad/model"] = _attempt(lambda: planc.load_optimizer(other, optimizer_for(other), root / "mixtral" / "ckpt"))
    foreign = torch.optim.AdamW(list(other.parameters()) + [torch.nn.Parameter(torch.zeros(3))], lr=LR)
    out["bad/foreign"] = _attempt(lambda: planc.load_optimizer(other, foreign, root / "qwen3_moe" / "ckpt"))
    grouped = Path(root) / GROUPED / "ckpt"
    for name, regrouped in (("one", torch.optim.AdamW(model.parameters(), lr=LR)),
                            ("moved", optimizer_for(model, GROUPED, undecayed=("norm", "gate.")))):
        out[f"bad/regrouped_{name}"] = _attempt(lambda o=regrouped: planc.load_optimizer(model, o, grouped))
    fresh = optimizer_for(model)
    out["bad/unstepped"] = _attempt(lambda: planc.save(model, root / "unstepped", optimizer=fresh))
    return out
