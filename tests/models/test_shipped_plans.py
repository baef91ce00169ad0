"""Every shipped plan is at least as good as `planc init --from-transformers` for its family: it holds no more
bytes per rank than init's plan at the same sizes, on the full-size model (meta device, no memory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from planc.compiler.resolve import compile_plan
from planc.lint.plan_loader import load_plan
from planc.models.build import build_meta_model
from planc.models.synthesis import init_plan
from planc.spec.source import parse_yaml

PLANS = sorted((Path(__file__).resolve().parents[2] / "plans").glob("*.yaml"))


@pytest.mark.parametrize("path", PLANS, ids=[p.stem for p in PLANS])
def test_shipped_plan_holds_no_more_per_rank_than_init(path):
    loaded = load_plan(str(path))
    plan = loaded.plan
    model = build_meta_model(plan.model.type)
    ours = compile_plan(model, loaded)
    init = parse_yaml(init_plan(plan.model.type, sizes=(plan.parallel.tp_size,))).data
    init["parallel"] = plan.parallel.model_dump()  # init's rules at the shipped plan's sizes
    theirs = compile_plan(model, load_plan(init))
    assert ours.bytes_per_rank <= theirs.bytes_per_rank, (
        f"{path.name} holds {ours.bytes_per_rank / 2**30:.2f} GiB per rank, `planc init --from-transformers "
        f"{plan.model.type}` {theirs.bytes_per_rank / 2**30:.2f} GiB at the same sizes: take init's rules"
    )
