"""Every compile rule's failing example is refused with its code, and its passing example compiles.

The examples are the ones `planc rules CODE` and docs/lint.md show; each is compiled against the tiny
random model of its `model.type` (with the rule's `config` overrides), as a user would.
"""

from __future__ import annotations

import pytest

import planc
from planc.errors import CompileError
from planc.lint.registry import all_rules
from planc.models.build import build_tiny_model
from planc.spec.source import parse_yaml

COMPILE_RULES = [r for r in all_rules() if r.family in ("compile", "layout")]
_MODELS: dict = {}


def _model(text: str, config):
    model_type = parse_yaml(text).data["model"]["type"]
    if model_type == "qwen3_moe":  # PLC607's example: a plan for another family, compiled against mixtral
        model_type = "mixtral"
    key = (model_type, tuple(sorted((config or {}).items())))
    if key not in _MODELS:
        _MODELS[key] = build_tiny_model(model_type, **(config or {}))
    return _MODELS[key]


def _codes(text: str, config) -> tuple[set, set]:
    try:
        compiled = planc.compile(_model(text, config), text)
    except CompileError as e:
        return {p.code for p in e.problems}, set()
    return set(), {w.code for w in compiled.warnings}


def test_every_code_the_compiler_reports_is_listed_by_a_fresh_process():
    """Each compile rule is registered beside its check; `planc rules` (a process that has imported no compiler
    module) must list every code that planc/compiler names, and nothing else as a compile rule. Linting, even a
    plan with errors, imports no compiler module: only the whole list does."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    compiler = Path(planc.__file__).parent / "compiler"
    named = {c for p in compiler.rglob("*.py") for c in re.findall(r'"(PLC\d{3})"', p.read_text())}
    listed = subprocess.run(
        [sys.executable, "-c", "import sys; from planc.lint.registry import all_rules, get; "
         "from planc.lint.runner import lint_text; "
         "assert lint_text('version: 1\\nmodel: {type: mixtral}\\nparallel: {tp_size: 0}\\n') and get('PLC402'); "
         "assert not any(m.startswith('planc.compiler') for m in sys.modules); "
         "print(' '.join(r.code for r in all_rules() if r.family in ('compile', 'layout')))"],
        capture_output=True, text=True, check=True).stdout.split()
    assert named == set(listed) == {r.code for r in COMPILE_RULES}


@pytest.mark.parametrize("rule", [r for r in COMPILE_RULES if r.bad], ids=lambda r: r.code)
def test_bad_example_is_refused_and_good_one_compiles(rule):
    errors, warnings = _codes(rule.bad, rule.config)
    assert rule.code in (warnings if rule.severity == "warning" else errors), (errors, warnings)
    errors, warnings = _codes(rule.good, rule.config)
    assert not errors and rule.code not in warnings, (errors, warnings)


def test_planc_rules_knows_compile_codes(capsys):
    from planc.cli import main

    assert main(["rules", "PLC601"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PLC601 rule-matches-nothing (error, compile)") and "Fails:" in out and "Passes:" in out
