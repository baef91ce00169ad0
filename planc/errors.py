"""Exceptions every layer raises. Each carries what is wrong, where, and what to write instead."""

from __future__ import annotations

from typing import Any, Iterable


class PlancError(Exception):
    """Base of planc's errors."""


class PlanError(PlancError):
    """A plan that does not load or validate. `diagnostics` holds every problem found (lint Diagnostics);
    `loaded`: the plan as it validated, when only lint rules refused it (the runtime reads its sizes)."""

    def __init__(self, diagnostics: Iterable[Any], loaded: Any = None) -> None:  # planc.lint Diagnostics (a layer up)
        self.diagnostics = list(diagnostics)
        self.loaded = loaded
        super().__init__("\n".join(d.format() if hasattr(d, "format") else str(d) for d in self.diagnostics))


class CompileError(PlancError):
    """A plan that cannot be resolved against this model. `problems` lists every conflict found, as
    Diagnostics (the shape lint reports in, plus the module path); `diagnostics` is the same list."""

    def __init__(self, problems: Iterable[Any]) -> None:  # planc.lint Diagnostics
        self.problems = list(problems)
        self.diagnostics = self.problems
        lines = [f"{len(self.problems)} problem(s) resolving the plan against the model:"]
        for p in self.problems:
            lines.append(f"  {p}")
        super().__init__("\n".join(lines))


class ApplyError(PlancError):
    """planc.apply could not install the plan; the model is left exactly as it was."""


class CheckpointError(PlancError):
    """A checkpoint that cannot be loaded as asked, or a planc.save / planc.export that could not complete:
    names the file and the tensor and what to do; an existing checkpoint is left intact."""


class ModelBuildError(PlancError, ValueError):
    """transformers could not build a config or a model: one line that names the model type and the cause.

    `planc init`, `planc explain` and `planc demo` print it as is (exit 2) instead of transformers'
    traceback; every way planc builds a model goes through planc.models.build, so none of them can leak one.
    """


class VerifyError(PlancError):
    """`planc verify` could not run (exit 2): a model source that does not build, a `--build` target that is not
    importable or returns no module, a shrink that would break a divisibility the plan relies on, sizes the host
    cannot run. The message says which input, why, and what to do instead."""


def one_line(text: object, limit: int | None = None) -> str:
    """`text` (a message, an exception) on one line, whitespace collapsed, cut to `limit` characters with `...`:
    a message from a dependency quoted inside one of planc's own."""
    line = " ".join(str(text).split())
    return line if limit is None or len(line) <= limit else line[: limit - 3] + "..."
