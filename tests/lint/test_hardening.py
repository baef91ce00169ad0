"""Issue 12: adversarial and first-time input gets a clear diagnostic in bounded time and memory.

Each test names the item of issue 12 it holds to. Work is bounded by counting (alternatives, peak
memory), never by timing.
"""

from __future__ import annotations

import os
import tracemalloc

import pytest

from planc.lint.runner import lint_file, lint_text
from planc.spec.patterns import MAX_ALTERNATIVES, Pattern, PatternError

from .helpers import GOOD, planc

HEAD = "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\n"


def _peak_mib(fn):
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1] / (1 << 20)
    finally:
        tracemalloc.stop()


# ---- 1. brace alternatives are counted before they are expanded ----------------------------------------


def test_brace_bomb_is_plc300_with_the_count_in_bounded_memory():
    text = HEAD + "tp_plan:\n  model." + "{a,b}" * 22 + ": colwise\n"
    assert len(text.encode()) < 250
    diags, peak = _peak_mib(lambda: lint_text(text, "bomb.yaml"))
    assert [d.code for d in diags] == ["PLC300"], [d.format() for d in diags]
    assert f"{2**22} alternatives" in diags[0].message and (diags[0].line, diags[0].col) == (5, 3)
    assert peak < 20, f"linting a 200-byte plan peaked at {peak:.0f} MiB"


def test_pattern_count_is_computed_without_expanding():
    with pytest.raises(PatternError, match=f"{10**8} alternatives") as e:
        Pattern("model." + ".".join(["{a,b,c,d,e,f,g,h,i,j}"] * 8))
    assert "split it" in e.value.hint
    assert len(Pattern("x.{" + ",".join(f"a{i}" for i in range(MAX_ALTERNATIVES)) + "}").alternatives) == MAX_ALTERNATIVES


def test_plan_wide_alternatives_budget():
    rules = "".join(f"  m{i}." + "{a,b}" * 7 + ".{x,y}: colwise\n" for i in range(6))  # 256 each, 1536 in all
    diags = lint_text(HEAD + "tp_plan:\n" + rules, "wide.yaml")
    assert [d.code for d in diags] == ["PLC300", "PLC300"], [d.format() for d in diags]
    assert "in total" in diags[0].message and diags[0].line == 9


def test_compile_and_load_reject_the_bomb_too():
    from planc.errors import PlanError
    from planc.lint.load import load_plan

    with pytest.raises(PlanError, match="PLC300"):
        load_plan(HEAD + "tp_plan:\n  model." + "{a,b}" * 30 + ": colwise\n")


# ---- 2. size hints in bounded time -----------------------------------------------------------------------


def test_huge_dp_size_is_its_own_diagnostic_and_hints_stay_bounded():
    text = "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 1, ep_size: 3, dp_size: 100000000000}\n"
    diags = [d for d in lint_text(text, "huge.yaml") if d.code.startswith("PLC5")]
    assert [d.code for d in diags] == ["PLC502"], [d.format() for d in diags]
    assert "dp_size" in diags[0].hint and (diags[0].line, diags[0].col) == (3, 45)


def test_plc501_hint_lists_divisors_of_a_large_world():
    text = "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2, ep_size: 6, dp_size: 524288}\n"
    diags = [d for d in lint_text(text) if d.code == "PLC501"]
    assert len(diags) == 1 and "[2, 4, 8, 16, 32, 64]" in diags[0].hint, [d.format() for d in diags]


# ---- 3. only regular files are read ----------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo")
def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "x.yaml"
    os.mkfifo(fifo)
    d = lint_file(str(fifo))
    assert [x.code for x in d] == ["PLC002"] and "FIFO" in d[0].message and "regular file" in d[0].message
    r = planc("lint", str(tmp_path), timeout=60)  # a directory walk finds it too
    assert r.returncode == 2 and "FIFO" in r.stdout, r.stdout + r.stderr


def test_character_device_is_refused():
    d = lint_file("/dev/zero")
    assert [x.code for x in d] == ["PLC002"] and "character device" in d[0].message
