"""Renderers for lint results: text (terminals, pre-commit), json (tools), github (Actions annotations)."""

from __future__ import annotations

import json
from typing import Sequence

from planc.lint.diagnostic import ERROR, WARNING, Diagnostic

def counts(diags: Sequence[Diagnostic]) -> tuple[int, int]:
    errors = sum(d.severity == ERROR for d in diags)
    return errors, sum(d.severity == WARNING for d in diags)


def render(diags: Sequence[Diagnostic], fmt: str, files: int, no_plans: int = 0) -> str:
    """`files`: plan files linted; `no_plans`: path arguments that gave none (missing, empty directory)."""
    return {"text": render_text, "json": render_json, "github": render_github}[fmt](diags, files, no_plans)


def render_text(diags: Sequence[Diagnostic], files: int, no_plans: int = 0) -> str:
    lines = [d.format() for d in diags]
    errors, warnings = counts(diags)
    plural = "s" if files != 1 else ""
    if diags:
        summary = f"{errors} error(s), {warnings} warning(s) in {files} file{plural}"
        if no_plans:
            summary += f"; {no_plans} path{'s' if no_plans != 1 else ''} had no plan to lint"
        lines.append(summary)
    else:
        lines.append(f"{files} file{plural} checked: no problems")
    return "\n".join(lines) + "\n"


def render_json(diags: Sequence[Diagnostic], files: int, no_plans: int = 0) -> str:
    errors, warnings = counts(diags)
    doc = {
        "files": files,
        "paths_without_plans": no_plans,
        "errors": errors,
        "warnings": warnings,
        "diagnostics": [d.to_json() for d in diags],
    }
    return json.dumps(doc, indent=2) + "\n"


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def render_github(diags: Sequence[Diagnostic], files: int, no_plans: int = 0) -> str:
    """One workflow command per diagnostic: `::error file=F,line=L,col=C,title=CODE::message%0Ahint`."""
    out = []
    for d in diags:
        level = "error" if d.severity == ERROR else "warning"
        props = f"file={_escape_property(d.path or '<string>')},line={d.line},col={d.col},title={_escape_property(d.code)}"
        body = f"{d.message}\nhint: {d.hint}" if d.hint else d.message
        out.append(f"::{level} {props}::{_escape_data(body)}")
    return "\n".join(out) + ("\n" if out else "")
