"""`planc demo [PLAN]`: apply a shipped plan on two CPU processes and compare with the unsharded model.

Two gloo ranks build the same tiny random model of the plan's family (a hand-tuned tiny config for
the shipped families, else one derived from the family's own config class: any MoE family
transformers can build works), one copy stays unsharded,
`planc.apply` shards the other with the plan (sizes overridden to 2 ranks), and rank 0 prints the
explain table and the max abs logits difference. Needs torch and transformers, no GPU, no network.
"""

from __future__ import annotations

import sys

from planc.spec.choices import EXPERTS_IMPLEMENTATIONS, MEGAMOE_BACKENDS
from planc.spec.shipped import shipped_plan

DEFAULT_PLAN = shipped_plan("mixtral")  # package data: there in a wheel too
WORLD = 2


def add_arguments(parser) -> None:
    parser.add_argument(
        "plan", nargs="?", default=str(DEFAULT_PLAN), help="plan file (default: plans/mixtral.yaml)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the tiny model and the batch")


def _plan_for_two_ranks(path: str) -> dict:
    from planc.lint.plan_loader import load_plan

    own = load_plan(path).plan.parallel
    data = load_plan(path, parallel={"tp_size": WORLD, "ep_size": WORLD, "dp_size": 1}).plan.model_dump()
    data["extends"] = None  # merged already
    data["_own_sizes"] = f"tp_size={own.tp_size} ep_size={own.ep_size} dp_size={own.dp_size}, {own.world_size} ranks"
    megamoe = data["experts"].get("megamoe")
    if EXPERTS_IMPLEMENTATIONS[data["experts"]["implementation"]].megamoe and megamoe and MEGAMOE_BACKENDS[
            megamoe["backend"]].per_device:
        megamoe["backend"] = "reference"  # the demo runs on CPU: the explicit pure-PyTorch backend
    return data


def _rank(rank: int, world: int, plan: dict, seed: int) -> dict[str, str]:
    """One rank of the demo (a gloo process group is already up): apply, compare; returns the report."""
    import torch

    from planc import apply
    from planc.models.build import build_tiny_model, clone_model

    model = build_tiny_model(plan["model"]["type"], seed=seed)
    reference = clone_model(model)
    megamoe = EXPERTS_IMPLEMENTATIONS[plan["experts"]["implementation"]].megamoe
    if not megamoe:
        reference.set_experts_implementation(plan["experts"]["implementation"])
    compiled = apply(model, plan)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        diff = (model(ids).logits - reference(ids).logits).abs().max().item()
    diff_note = " (FP4 experts vs the bf16/fp32 unsharded model)" if megamoe else ""
    text = f"{compiled}\n\nmax |logits - unsharded logits| on {world} ranks: {diff:.3e}{diff_note}\n"
    return {"text": text, "model": _model_sizes(model.config)}


def _model_sizes(config) -> str:
    """The tiny model's sizes, as the config names them (hidden size, layers, experts)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    parts = []
    for label, names in (("hidden", ("hidden_size",)), ("layers", ("num_hidden_layers",)),
                         ("experts", ("num_local_experts", "num_experts", "n_routed_experts"))):
        value = next((getattr(text, n) for n in names if isinstance(getattr(text, n, None), int)), None)
        if value is not None:
            parts.append(f"{label} {value}")
    return ", ".join(parts)



def _check_before_spawning(path: str, plan: dict, seed: int) -> int:
    """Build the tiny model and compile the plan against it here, so that a family transformers cannot
    build or a plan that does not resolve fails in a second with one message, not after spawning ranks."""
    from planc.compiler.resolve import compile_plan
    from planc.errors import CompileError, ModelBuildError
    from planc.lint.plan_loader import load_plan
    from planc.models.build import build_tiny_model

    try:
        model = build_tiny_model(plan["model"]["type"], seed=seed)
    except ModelBuildError as e:
        print(f"planc demo: {e}", file=sys.stderr)
        return 2
    try:
        compile_plan(model, load_plan(plan))
    except CompileError as e:
        print(f"planc demo: {path} does not resolve against a tiny {type(model).__name__} on {WORLD} ranks:\n{e}",
              file=sys.stderr)
        return 1
    return 0


def run(args) -> int:
    import torch.multiprocessing as mp  # the runtime extra: planc.cli checked it is installed

    from planc.runtime.local_world import run_local_world

    try:
        plan = _plan_for_two_ranks(args.plan)
        own_sizes = plan.pop("_own_sizes")
    except Exception as e:  # noqa: BLE001 - a plan error is the user's to fix: print it, exit 1
        print(f"planc demo: {args.plan}: {e}", file=sys.stderr)
        return 1
    status = _check_before_spawning(args.plan, plan, args.seed)
    if status:
        return status
    try:
        report = run_local_world(_rank, WORLD, plan, args.seed)[0]
    except mp.ProcessRaisedException as e:
        print(f"planc demo: a rank failed:\n{e}", file=sys.stderr)
        return 1
    p = plan["parallel"]
    print(
        f"planc demo: {args.plan} applied to a tiny random {plan['model']['type']} ({report['model']}) on {WORLD} "
        f"CPU ranks (gloo), run at tp_size={p['tp_size']} ep_size={p['ep_size']} dp_size={p['dp_size']} "
        f"(the plan's own sizes: {own_sizes}; the table keeps its name)\n"
    )
    report = report["text"]
    print(report, end="")
    return 0
