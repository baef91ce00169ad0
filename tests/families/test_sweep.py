"""Every MoE family of the installed transformers: init -> lint -> explain -> apply on 2 gloo ranks.

The families are found at test time (`planc.models.families.moe_families`), each on a tiny config
derived from its own config class. One sweep (one spawned 2-rank world for every family and every
shipped plan) is shared by all tests here through a module fixture; they are marked `sweep` and
grouped (`xdist_group`, with `--dist loadgroup` in pyproject.toml) so that under `pytest -n 2` the
sweep runs once, on one worker, while the other worker runs the rest of the suite; `.ci/run` bounds
the whole test run with `timeout` so CI stays within its 30 minutes. `pytest -m "not sweep"` skips it. Every outcome must be `pass` or a refusal that carries a planc rule code; a
refusal is checked against the reason its code stands for.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import planc
from planc.models.families import family, moe_families
from planc.models.build import build_meta_model
from tests.families.sweep import family_status, render_models_md, run_sweep

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ["qwen3_vl_moe", "glm4_moe", "minimax_m2", "llama4", "qwen3_next", "deepseek_v2"]

# What each code a family may be refused with stands for, checked against the refusal's own text.
REFUSAL_REASONS = {
    "PLC606": re.compile(r"experts cannot be split evenly over ep_size"),
    "PLC617": re.compile(r"not a\s+whole number of heads"),
    "PLC616": re.compile(r"does not divide evenly"),
    "PLC623": re.compile(r"gets no style whose forward runs on local shards"),
    "PLC624": re.compile(r"cannot switch its experts implementation"),
    "PLC613": re.compile(r"needs an experts module|pre-scaled|is a parameter style|is not an experts module"),
    "PLC602": re.compile(r"has no EP or TP rule"),
}


# Causes outside planc a family may be reported with (status `transformers`): a top model that only generates
# and holds no submodule built from the family's config with a forward of its own (none in transformers 5.24:
# the Qwen3 Omni MoE talker family is compared on its talker, see tests/models/test_tiny.py).
OUTSIDE_PLANC = [re.compile(r"has no forward of its own \(it only generates\)")]

# Families transformers' default configs could not build a tiny model of until the derivation filled in
# what the defaults leave None or inconsistent: each must now pass every step, or be reported
# with a cause outside planc.
FORMERLY_NOT_BUILT = [
    "deepseek_ocr2_text", "diffusion_gemma_text", "dots1", "dots3_note_text", "dots3_note_vision_encoder",
    "ernie4_5_vl_moe_text", "glm4v_moe_text", "glm5_next_text", "granitemoehybrid", "lfm2_moe",
    "mistral_large4_text", "muse_spark_text", "nemotron_h", "qwen3_omni_moe_talker_text", "qwen4_exp_text",
    "step3p5", "unlimited_ocr_text",
]


# Families that once got no expert parallelism from the sweep: longcat_flash runs its own experts
# forward with parameter-free experts, gemma4_text's experts are behind `enable_moe_block`, flint's first layers
# are dense, hunyuan_v1_moe's default has 1 expert. Each must now run every EP strategy.
EP_REQUIRED = ["longcat_flash", "gemma4_text", "flint", "hunyuan_v1_moe"]


def _first_worker_to_sweep(tmp_path_factory) -> None:
    """Fail instead of sweeping a second time when `--dist loadgroup` split the group over workers (it does so
    silently under pytest 9.2 with pytest-xdist 3.8, pytest-dev/pytest-xdist#1386: minutes more on 2 cores)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    # the workers' base temporary directories share this run's parent
    claim = tmp_path_factory.getbasetemp().parent / "family_sweep.worker"
    try:
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        pytest.fail(f"the family sweep already ran on {claim.read_text() or 'another worker'}, and {worker} was "
                    "asked for it too: `--dist loadgroup` did not keep the xdist_group on one worker. Install "
                    "the test extra's pytest (`pip install -e '.[test]'`: pytest<9.2, pytest-dev/pytest-xdist#1386)")
    with os.fdopen(fd, "w") as f:
        f.write(worker)


# session scope: under xdist a worker may run other modules' tests between these, and a module fixture would be
# torn down and the whole sweep run again
@pytest.fixture(scope="session")
def sweep(tmp_path_factory):
    _first_worker_to_sweep(tmp_path_factory)
    shipped = {f"plans/{name}.yaml": (ROOT / "plans" / f"{name}.yaml").read_text() for name in SHIPPED}
    return run_sweep(shipped=shipped)


@pytest.mark.sweep
@pytest.mark.distributed
@pytest.mark.xdist_group("family_sweep")
def test_every_family_passes_or_is_refused_with_its_code(sweep):
    records, _ = sweep
    assert {f.text_type for f in moe_families()} == set(records)
    # the tiny-config derivation builds every family; a family transformers' own unsharded model cannot check
    # (a top model without a forward of its own, and no submodule of the family's config with one) names that
    # cause, which lies outside planc
    not_built = {n: rec for n, rec in records.items() if family_status(rec) == "not built"}
    assert not not_built, not_built
    outside = {n: rec["apply"]["build"] for n, rec in records.items() if family_status(rec) == "transformers"}
    for name, cause in outside.items():
        assert any(p.search(cause) for p in OUTSIDE_PLANC), (name, cause)
    built = [n for n in records if n not in outside]
    problems = []
    for name, rec in sorted(records.items()):
        if name not in built:
            continue
        outcomes = {k: rec[k] for k in ("init", "lint", "explain") if k in rec}
        outcomes.update({f"apply/{k}": v for k, v in (rec.get("apply") or {}).items()})
        for step, outcome in outcomes.items():
            if outcome == "pass" or outcome.startswith("refused init:"):
                continue
            m = re.match(r"refused (PLC\d{3}): (.*)", outcome)
            if m is None:
                problems.append(f"{name} {step}: {outcome}")
            elif m.group(1) in REFUSAL_REASONS and not REFUSAL_REASONS[m.group(1)].search(m.group(2)):
                problems.append(f"{name} {step}: {m.group(1)} with a reason that is not its own: {m.group(2)}")
    assert not problems, "\n".join(problems)


@pytest.mark.sweep
@pytest.mark.distributed
@pytest.mark.xdist_group("family_sweep")
def test_formerly_unbuilt_families_pass(sweep):
    records, _ = sweep
    status = {n: family_status(records[n]) for n in FORMERLY_NOT_BUILT if n in records}
    assert status == {n: "pass" for n in status}, status


@pytest.mark.sweep
@pytest.mark.distributed
@pytest.mark.xdist_group("family_sweep")
def test_families_once_without_ep_run_every_strategy(sweep):
    records, _ = sweep
    got = {n: (records[n].get("ep"), records[n].get("apply")) for n in EP_REQUIRED if n in records}
    want = {n: (True, {s: "pass" for s in ("all_to_all", "all_reduce", "auto")}) for n in got}
    assert got == want


@pytest.mark.sweep
@pytest.mark.distributed
@pytest.mark.xdist_group("family_sweep")
def test_init_refusals_name_their_cause(sweep):
    records, _ = sweep
    for name, rec in records.items():
        init = rec.get("init", "pass")
        if init.startswith("refused init:"):
            assert "PLC" in init or "cannot build" in init or "no plan for" in init, (name, init)


@pytest.mark.sweep
@pytest.mark.distributed
@pytest.mark.xdist_group("family_sweep")
def test_shipped_plans_apply_on_tiny_models(sweep):
    _, plans = sweep
    assert set(plans) == {f"plans/{n}.yaml" for n in SHIPPED}
    bad = {p: r for p, r in plans.items() if not r or any(v != "pass" for v in r.values())}
    assert not bad, bad


@pytest.mark.sweep
@pytest.mark.distributed
@pytest.mark.xdist_group("family_sweep")
def test_models_md_is_current(sweep):
    import transformers
    from packaging.version import Version

    have = (ROOT / "docs" / "models.md").read_text()
    written = re.search(r"Every MoE family of transformers (\S+) ", have)
    assert written, "docs/models.md does not name the transformers it was written from"
    if Version(transformers.__version__) < Version(written[1]):
        pytest.skip(f"docs/models.md is written from transformers {written[1]}; an older one "
                    f"({transformers.__version__}) has fewer families and cannot check it")
    records, _ = sweep
    want = render_models_md(records, transformers.__version__)
    assert have == want, "docs/models.md is stale: run `python -m tests.families.sweep --write docs/models.md`"


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_plan_explains_on_the_full_size_model(name):
    import yaml

    path = ROOT / "plans" / f"{name}.yaml"
    model_type = yaml.safe_load(path.read_text())["model"]["type"]
    compiled = planc.compile(build_meta_model(model_type), str(path))
    assert compiled.full_coverage and compiled.experts_covered == len(compiled.experts) > 0
    assert compiled.parallel.world_size == 8  # one 8-GPU node
    assert family(model_type).model_type == model_type
