"""Diagnostic formatting and the text/json/github renderers."""

from __future__ import annotations

import json

from planc.lint.diagnostic import Diagnostic
from planc.lint.report import render
from planc.spec.source import Position

D = Diagnostic("PLC310", "error", "unknown style `a,b: c`", "did you mean `x`?\n50% sure", Position("p, q.yaml", 3, 7))
W = Diagnostic("PLC405", "warning", "no EP group", "set ep_size", Position("p.yaml", 1, 1))


def test_format_shape():
    # each part stays on its line: a newline from the plan is printed escaped
    assert D.format() == "p, q.yaml:3:7: PLC310 error: unknown style `a,b: c`\n    hint: did you mean `x`?\\n50% sure"
    assert Diagnostic("PLC100", "error", "m", "h", None).format().startswith("<mapping>: PLC100 error: m")


def test_text_summary():
    assert render([D, W], "text", 2).endswith("1 error(s), 1 warning(s) in 2 files\n")
    assert render([], "text", 1) == "1 file checked: no problems\n"


def test_json_roundtrip():
    doc = json.loads(render([D], "json", 1))
    assert doc["diagnostics"][0] == {
        "path": "p, q.yaml", "line": 3, "col": 7, "end_line": 3, "end_col": 7, "code": "PLC310", "severity": "error",
        "message": "unknown style `a,b: c`", "hint": "did you mean `x`?\n50% sure",
    }


def test_json_end_positions_cover_the_node():
    """The JSON names where the offending node ends too (editors underline it): the value `row_wise`."""
    from planc.lint.runner import lint_text

    from .helpers import GOOD

    text = GOOD.replace("o_proj: rowwise", "o_proj: row_wise")
    (d,) = json.loads(render(lint_text(text, "p.yaml"), "json", 1))["diagnostics"]
    line = text.splitlines()[d["line"] - 1]
    assert d["code"] == "PLC310" and d["end_line"] == d["line"]
    assert line[d["col"] - 1 : d["end_col"] - 1] == "row_wise"


def test_github_escapes_properties_and_data():
    out = render([D, W], "github", 2).splitlines()
    assert out[0] == (
        "::error file=p%2C q.yaml,line=3,col=7,title=PLC310::unknown style `a,b: c`"
        "%0Ahint: did you mean `x`?%0A50%25 sure"
    )
    assert out[1].startswith("::warning file=p.yaml,line=1,col=1,title=PLC405::")
    assert render([], "github", 0) == ""
