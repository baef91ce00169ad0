"""Diagnostic: one problem in a plan, with where it is and what to write instead.

The one shape every layer reports in: the loader, the schema, the lint rules and the compiler
(`CompileError.problems` and `CompiledPlan.warnings` are Diagnostics too, with the module path they
concern), so the CLI, pre-commit, `load_plan` errors, `planc explain` and the JSON/GitHub reports all
print the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # annotations only: `import planc` imports this module (the rule registry) without yaml
    from planc.spec.source import Position

ERROR = "error"
WARNING = "warning"


def one_line(text: str) -> str:
    """`text` with every non-printable character (newline, CR, ESC, U+2028...) written as a Python escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


@dataclass(frozen=True)
class Diagnostic:
    code: str  # stable rule code, e.g. PLC401 (see `planc rules`)
    severity: str  # "error" | "warning"
    message: str  # what is wrong
    hint: str  # what to write instead
    position: Optional[Position] = None  # where; None only for problems with no file (a mapping plan)
    module: Optional[str] = None  # compile diagnostics: the module/parameter path (generic with a count when many)
    key: Optional[str] = None  # where, when there is no position: `tp_plan['lm_head']` for a plan built in code
    # the text that replaces the node at `position` (a did-you-mean sure enough to offer): editors' quick fix
    fix: Optional[str] = field(default=None, compare=False)

    @property
    def where(self) -> str:
        """`file:line:col`, or the plan key for a plan with no file (`<mapping>` when no key is known)."""
        if self.position is not None:
            return self.location()
        return self.key or "<mapping>"

    @property
    def path(self) -> Optional[str]:
        return self.position.path if self.position else None

    @property
    def line(self) -> int:
        return self.position.line if self.position else 1

    @property
    def col(self) -> int:
        return self.position.col if self.position else 1

    @property
    def end(self) -> tuple[int, int]:
        """(line, col) just past the offending node; the start itself when the parser gave no end."""
        p = self.position
        if p is None or p.end_line is None or p.end_col is None:
            return self.line, self.col
        return p.end_line, p.end_col

    def location(self) -> str:
        return f"{self.path or '<string>'}:{self.line}:{self.col}"

    def format(self) -> str:
        """`path:line:col: CODE severity: message`, the module line (compile diagnostics) and an indented hint
        line, each exactly one line: control characters from the plan (a pattern with a newline, an escape
        sequence) are escaped."""
        text = f"{one_line(self.where)}: {self.code} {self.severity}: {one_line(self.message)}"
        if self.module:
            text += f"\n    module: {one_line(self.module)}"
        return f"{text}\n    hint: {one_line(self.hint)}" if self.hint else text

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "line": self.line,
            "col": self.col,
            "end_line": self.end[0],
            "end_col": self.end[1],
            "code": self.code,
            "severity": self.severity,
            "message": self.message,
            "hint": self.hint,
            **({"module": self.module} if self.module else {}),
            **({"fix": self.fix} if self.fix is not None else {}),
        }

    def sort_key(self) -> tuple[str, int, int, str, str]:
        return (self.path or "", self.line, self.col, self.code, self.message)

    def __str__(self) -> str:
        return self.format()
