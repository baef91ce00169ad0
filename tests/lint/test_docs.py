"""The docs agree with the code: every rule documented (generated section current), codes the docs name exist.

The plans of docs/plan-format.md (and every other page) are linted by tests/test_docs.py, each as its
`<!-- lint: ... -->` marker expects.
"""

from __future__ import annotations

import re


from planc.lint.docs import render
from planc.lint.registry import all_rules
from planc.lint.runner import lint_text

from .helpers import REPO

LINT_MD = REPO / "docs" / "lint.md"
FORMAT_MD = REPO / "docs" / "plan-format.md"


def test_generated_rules_section_is_current():
    text = LINT_MD.read_text()
    assert render(text) == text, "docs/lint.md is stale: run `python -m planc.lint.docs docs/lint.md`"


def test_every_registered_code_is_documented():
    text = LINT_MD.read_text()
    for r in all_rules():
        assert f"#### {r.code}\n" in text and f"`{r.name}`" in text, r.code


def test_every_code_the_docs_mention_exists():
    from planc.lint.registry import RETIRED

    codes = {r.code for r in all_rules()} | set(RETIRED)  # `planc rules` answers a retired code too
    for md in (LINT_MD, FORMAT_MD):
        for code in set(re.findall(r"PLC\d{3}", md.read_text())):
            assert code in codes, f"{md.name} mentions unknown {code}"


def test_lint_md_sample_output_is_what_planc_prints():
    sample = re.search(r"```text\n(plans/bad.yaml:\d+:\d+: (PLC\d{3}) .*?)\n```", LINT_MD.read_text(), re.S)
    assert sample
    text = (
        "version: 1\nmodel: {type: deepseek_v4}\nparallel: {tp_size: 8, ep_size: 8}\nexperts:\n"
        "  implementation: deepgemm_megamoe\n" + "\n" * 8 + "  ep_implementation: all_to_all\n"
        "ep_plan:\n  model.layers.*.mlp.experts: ep_dispatch_experts\n"
    )
    from planc.lint.report import render_text

    assert render_text(lint_text(text, "plans/bad.yaml"), 1).strip() == sample.group(1).strip()
