"""`planc demo`: two CPU ranks apply the shipped plan and print the explain table and the logits difference."""

import re

import pytest

from planc.cli import main


@pytest.mark.distributed
def test_demo_prints_table_and_matches_unsharded(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.*.mlp.experts" in out  # the explain table lists the plan's rules
    assert "run at tp_size=2 ep_size=2 dp_size=1 (the plan's own sizes: tp_size=8 ep_size=8 dp_size=1, 8 ranks" in out
    assert "tiny random mixtral (hidden " in out and "experts 8" in out
    match = re.search(r"max \|logits - unsharded logits\| on 2 ranks: (\S+)", out)
    assert match, out
    assert float(match.group(1)) <= 1e-5


def test_demo_reports_a_bad_plan(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2, tp_sise: 2}\n")
    assert main(["demo", str(bad)]) == 1
    assert "tp_sise" in capsys.readouterr().err


def _gpt_oss_rank(rank: int, world: int, plan: dict, seed: int) -> dict:
    """The demo's comparison on gpt_oss, then rank 1 scales its own experts shard: rank 0's logits must move."""
    import torch
    import torch.distributed as dist

    from planc import apply
    from planc.models.build import build_tiny_model, clone_model

    model = build_tiny_model("gpt_oss", seed=seed)
    reference = clone_model(model)
    reference.set_experts_implementation(plan["experts"]["implementation"])
    apply(model, plan)
    experts = model.model.layers[0].mlp.experts
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        logits = model(ids).logits
        diff = (logits - reference(ids).logits).abs().max().item()
        if rank == 1:
            experts.gate_up_proj.to_local().mul_(1.5)
        dist.barrier()
        moved = (model(ids).logits - logits).abs().max().item()
    return {"diff": diff, "moved": moved, "local_experts": experts.gate_up_proj.to_local().shape[0]}


@pytest.mark.distributed
def test_the_gpt_oss_demos_exact_zero_compares_two_computations():
    """gpt_oss's plan adds no partial sums across ranks (vocab-parallel embedding: one rank's row is not zero; the
    lm_head gathered whole; experts whole on their rank), so its demo prints exactly 0. That 0 is not a model compared
    with itself: each rank holds half the experts, and a change to rank 1's half moves rank 0's logits."""
    from planc.commands.demo import _plan_for_two_ranks
    from planc.runtime.local_world import run_local_world
    from planc.spec.shipped import shipped_plan

    plan = _plan_for_two_ranks(str(shipped_plan("gpt_oss")))
    plan.pop("_own_sizes")
    for report in run_local_world(_gpt_oss_rank, 2, plan, 0):
        assert report["diff"] == 0.0 and report["local_experts"] == 4, report
        assert report["moved"] > 1e-3, report
