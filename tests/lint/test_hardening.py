"""Adversarial and first-time input gets a clear diagnostic in bounded time and memory.

Work is bounded by counting (alternatives, peak
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
    from planc.lint.plan_loader import load_plan

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


# ---- 7. YAML 1.2 core scalars; anything YAML 1.1 reads differently is an error ---------------------------

PLAN = "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: %s}\n"


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("010", "the integer 10 in YAML 1.2"),
        ("0x10", "written in another base"),
        ("0o10", "the integer 8 in YAML 1.2"),
        ("0b11", "the integer 3 in YAML 1.1"),
        ("1:00", "the integer 60 in YAML 1.1"),
        ("1_0", "the integer 10 in YAML 1.1"),
        ("1e3", "a string in YAML 1.1"),
        ("!!int 010", "the integer 8 in YAML 1.1"),
    ],
)
def test_integer_forms_that_tools_read_differently_are_plc011(value, fragment):
    diags = lint_text(PLAN % value, "p.yaml")
    d = [x for x in diags if x.code == "PLC011"]
    assert len(d) == 1 and fragment in d[0].message and (d[0].line, d[0].col) == (3, 21), [x.format() for x in diags]
    assert "write `" in d[0].hint or "quote it" in d[0].hint


def test_yaml_1_1_booleans_dates_and_the_yaml_directive():
    diags = lint_text("%YAML 1.2\n---\n" + PLAN % 8 + "name: on\ndescription: 2024-01-01\n")
    assert [(d.code, d.line) for d in diags] == [("PLC011", 6), ("PLC011", 7)], [d.format() for d in diags]
    assert "`true`" in diags[0].hint and "'on'" in diags[0].hint
    assert lint_text("%YAML 1.2\n---\n" + PLAN % 8 + "name: 'on'\n") == []


def test_plain_values_read_as_yaml_1_2():
    from planc.spec.source import parse_yaml

    data = parse_yaml("a: 8\nb: -3\nc: 0.5\nd: .inf\ne: true\nf: ~\ng: off-by-one\nh: 'yes'\n").data
    assert data == {"a": 8, "b": -3, "c": 0.5, "d": float("inf"), "e": True, "f": None, "g": "off-by-one", "h": "yes"}
    assert type(data["a"]) is int and type(data["e"]) is bool


@pytest.mark.parametrize("value", ["true", "1.0"])
def test_version_must_be_the_integer_1(value):
    diags = lint_text(f"version: {value}\nmodel: {{type: mixtral}}\nparallel: {{tp_size: 2}}\n")
    assert [d.code for d in diags] == ["PLC102"] and "`version: 1`" in diags[0].hint, [d.format() for d in diags]


def test_every_form_check_jsonschema_accepts_differently_is_rejected(tmp_path):
    """The promise of PLC102/PLC011: a value check-jsonschema and planc read differently never lints clean."""
    import shutil
    import subprocess

    from .helpers import REPO

    exe = shutil.which("check-jsonschema") or os.path.join(os.path.dirname(os.sys.executable), "check-jsonschema")
    for value in ("010", "0x10", "0b11", "1_0", "1e3"):
        p = tmp_path / "p.yaml"
        p.write_text(PLAN % value)
        r = subprocess.run([exe, "--schemafile", str(REPO / "schemas" / "plan.schema.json"), str(p)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout  # the JSON Schema tool takes it, reading its own value ...
        assert any(d.severity == "error" for d in lint_file(str(p))), value  # ... so planc refuses it


# ---- 9. a NUL in `extends` is a bad value at its own position --------------------------------------------


def test_extends_with_a_nul_byte(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text('version: 1\nextends: "base.yaml\\0"\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\n')
    d = lint_file(str(p))
    assert [(x.code, x.line, x.col) for x in d] == [("PLC202", 2, 10)] and "\\x00" in d[0].message, d


# ---- 14. messages: quote hints, no spurious duplicates, positions at the key, one line each -------------


def test_yaml_1_1_boolean_pattern_gets_a_quote_hint():
    d = lint_text(HEAD + "tp_plan: {on: colwise}\n")
    assert [x.code for x in d] == ["PLC011"] and "quote it (`'on'`)" in d[0].hint and (d[0].line, d[0].col) == (4, 11)


def test_number_and_boolean_keys_are_reported_at_the_key_without_a_spurious_duplicate():
    d = lint_text(HEAD + "tp_plan: {1: colwise, true: rowwise}\n")
    assert [(x.code, x.col) for x in d] == [("PLC012", 11), ("PLC012", 23)], [x.format() for x in d]
    assert "quote it: `'1'`" in d[0].hint
    d = lint_text(HEAD + "1: x\n")
    assert {(x.code, x.line, x.col) for x in d} == {("PLC012", 4, 1), ("PLC101", 4, 1)}, [x.format() for x in d]
    d = lint_text(HEAD + "tp_plan:\n  model.layers: colwise\n  1.5: colwise\n")
    assert [(x.code, x.line, x.col) for x in d] == [("PLC012", 6, 3)], [x.format() for x in d]


def test_a_pattern_with_a_newline_stays_on_one_line():
    d = lint_text(HEAD + 'tp_plan:\n  "model.a\\nb\\x1b[2J": colwise\n', "p.yaml")
    text = d[0].format()
    assert text.count("\n") == 1 and "\\n" in text and "\x1b" not in text, text


# ---- 15. CLI conventions ---------------------------------------------------------------------------------


def test_version_flag():
    from planc import __version__

    r = planc("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"planc {__version__}", r.stdout + r.stderr


def test_unknown_option_prints_the_commands_usage():
    r = planc("lint", "--bogus")
    assert r.returncode == 2 and r.stderr.startswith("usage: planc lint "), r.stderr
    assert "planc lint: error: unrecognized arguments: --bogus" in r.stderr


def test_summary_counts_files_and_paths_without_plans(tmp_path):
    (tmp_path / "good.yaml").write_text(GOOD)
    (tmp_path / "empty").mkdir()
    r = planc("lint", str(tmp_path / "good.yaml"), str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and r.stdout.splitlines()[-1].endswith("in 1 file; 1 path had no plan to lint"), r.stdout
    r = planc("lint", str(tmp_path / "empty"))
    assert r.returncode == 1 and r.stdout.splitlines()[-1].endswith("in 0 files; 1 path had no plan to lint"), r.stdout
