"""Running the linter: files and directories in, sorted Diagnostics out, never an exception.

One pipeline serves `planc lint`, pre-commit and `load_plan`: read (size, encoding) -> parse (YAML,
positions, duplicate keys) -> resolve `extends` -> validate (pydantic) -> rule checks. A stage that
fails stops that file with its diagnostic; the pattern and style rules still run when validation
fails, because they read the raw rule tables.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Union

from planc.lint.context import LintContext
from planc.lint.diagnostic import ERROR, Diagnostic
from planc.spec.shipped import SHIPPED_PREFIX, shipped_names, shipped_plans, shipped_reference
from planc.spec.source import UNREADABLE, Position, SourceDoc, SourceError, parse_yaml, read_text

if TYPE_CHECKING:
    from pydantic import ValidationError

    from planc.spec.loaded_plan import LoadedPlan

PLAN_SUFFIXES = (".yaml", ".yml")


# One path, or several (files and directories).
PathsArg = Union[str, "os.PathLike[str]", Iterable[Union[str, "os.PathLike[str]"]]]


@dataclass
class CheckResult:
    """Diagnostics of one plan, and the LoadedPlan when it validated (load_plan uses it)."""

    diagnostics: list[Diagnostic] = field(default_factory=list)
    loaded: Optional[LoadedPlan] = None


def from_source_error(e: SourceError) -> Diagnostic:
    from planc.lint.registry import severity_of

    return Diagnostic(e.code, severity_of(e.code), e.message, e.hint, e.position)


def internal_error(exc: BaseException, path: Optional[str]) -> Diagnostic:
    from planc.lint.rules_source import INTERNAL

    return Diagnostic(
        INTERNAL, ERROR, f"planc failed on this file: {type(exc).__name__}: {exc}",
        "please report this with the plan attached", Position(path, 1, 1),
    )


def check_doc(doc: SourceDoc, root_dir: Optional[str] = None) -> CheckResult:
    """All checks of one parsed document (its `extends` resolved inside `root_dir`)."""
    from planc.spec.loaded_plan import resolve_extends

    try:
        merged = resolve_extends(doc, root_dir)
    except SourceError as e:
        return CheckResult([from_source_error(p) for p in doc.problems] + [from_source_error(e)])
    diags = [from_source_error(p) for p in merged.problems]
    ctx = LintContext(merged.data, None, doc.path, merged.key_positions, merged.value_positions)
    result = _check_context(ctx, diags)
    if result.loaded is not None:
        result.loaded.docs = merged.docs
    return result


def check_context(ctx: LintContext) -> CheckResult:
    """All checks over already-merged data (`load_plan(..., parallel=...)` re-checks a plan at other sizes)."""
    try:
        return _check_context(ctx, [])
    except Exception as exc:  # noqa: BLE001 - linting never raises: a bug in a check becomes a diagnostic
        return CheckResult([internal_error(exc, ctx.path)])


def _check_context(ctx: LintContext, diags: list[Diagnostic]) -> CheckResult:
    from pydantic import ValidationError

    from planc.lint.registry import checks
    from planc.lint.rules_schema import from_validation
    from planc.spec.loaded_plan import LoadedPlan, validate

    diags += project_extension_problems()
    try:
        ctx.plan = validate(ctx.data)
    except ValidationError as err:
        diags += from_validation(err, ctx)
    for r in checks():  # schema-family checks come first (registry order)
        if r.check is None or (r.needs_plan and ctx.plan is None):
            continue
        try:
            found = list(r.check(ctx))
        except Exception as exc:  # noqa: BLE001 - a bug in one check must not hide the others' findings
            found = [internal_error(exc, ctx.path)]
        diags += found
        if r.family == "schema" and found:  # the Plan holds coerced values: semantic rules would mislead
            ctx.plan = None
    diags = _unique(diags)
    loaded = None
    if ctx.plan is not None:
        loaded = LoadedPlan(ctx.plan, ctx.path, [], ctx.key_positions, ctx.value_positions)
    return CheckResult(diags, loaded)


def project_extension_problems() -> list[Diagnostic]:
    """The project's registered styles and strategies imported (pyproject.toml [tool.planc] extensions, once), so
    that a plan naming one lints like a plan naming planc's own; a module that failed is PLC313 at the config."""
    from planc.lint.rules_styles import EXTENSION_NOT_LOADED
    from planc.spec.extensions import load_project_extensions

    return [Diagnostic(EXTENSION_NOT_LOADED, ERROR, p.message, p.hint, Position(p.path, p.line, p.col))
            for p in load_project_extensions()]


def _check_source(
    parse: Callable[[], SourceDoc], path: Optional[str], root_dir: Optional[str] = None
) -> CheckResult:
    """Parse, then check; a parse failure is the one diagnostic, and nothing raises."""
    try:
        try:
            doc = parse()
        except SourceError as e:
            return CheckResult([from_source_error(e)])
        return check_doc(doc, root_dir)
    except Exception as exc:  # noqa: BLE001 - linting never raises: a bug in a check becomes a diagnostic
        return CheckResult([internal_error(exc, path)])


def check_file(path: str, root_dir: Optional[str] = None) -> CheckResult:
    return _check_source(lambda: parse_yaml(read_text(path), path), path, root_dir)


def check_text(text: str, path: Optional[str] = None) -> CheckResult:
    """Lint YAML text; `path` (optional) names it in positions and anchors relative `extends`."""
    return _check_source(lambda: parse_yaml(text, path), path)


def check_data(data: Mapping[str, Any]) -> CheckResult:
    """Lint a plan given as a mapping (no positions, no `extends` resolution)."""
    try:
        return _check_context(LintContext(dict(data), None, None, {}, {}), [])
    except Exception as exc:  # noqa: BLE001 - linting never raises: a bug in a check becomes a diagnostic
        return CheckResult([internal_error(exc, None)])


def lint_file(path: str) -> list[Diagnostic]:
    return check_file(path).diagnostics


def lint_text(text: str, path: Optional[str] = None) -> list[Diagnostic]:
    return check_text(text, path).diagnostics


def diagnostics_from_validation(err: ValidationError, path: Optional[str], positions: Any) -> list[Diagnostic]:
    """Diagnostics for a pydantic ValidationError of a Plan.

    `positions` is a mapping of key path -> Position (key positions), or anything with
    `key_positions` / `value_positions` (a SourceDoc, LoadedPlan or MergedSource).
    """
    keys = getattr(positions, "key_positions", positions) or {}
    values = getattr(positions, "value_positions", {}) or {}
    from planc.lint.rules_schema import from_validation

    return from_validation(err, LintContext({}, None, path, dict(keys), dict(values)))


def expand_paths(paths: Iterable[str]) -> tuple[list[str], list[Diagnostic]]:
    """Files to lint (directories walked for *.yaml / *.yml, hidden entries skipped) and the
    diagnostics for paths that do not exist or directories that hold no plans."""
    from planc.lint.rules_source import NO_PLANS

    files: list[str] = []
    diags: list[Diagnostic] = []
    for path in paths:
        if os.path.isdir(path):
            found = []
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                found += [os.path.join(root, n) for n in sorted(names)
                          if n.endswith(PLAN_SUFFIXES) and not n.startswith(".")]
            if not found:
                diags.append(Diagnostic(
                    NO_PLANS, ERROR, f"directory `{path}` holds no plan files (*.yaml, *.yml)",
                    "pass the directory that holds the plans, or the plan files themselves", Position(path, 1, 1),
                ))
            files += found
        elif os.path.exists(path):
            files.append(path)
        elif shipped_reference(path) is not None:
            files.append(str(shipped_reference(path)))
        else:
            diags.append(missing_path(path))
    return files, diags


def _stem(name: str) -> str:
    """A file name without its plan suffix (`mixtral.yaml` -> `mixtral`)."""
    for suffix in PLAN_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def missing_path(path: str) -> Diagnostic:
    """PLC002 for a plan path that does not exist (`planc lint`, `planc explain`, `load_plan` all say the same):
    the name it may mean (the path with `.yaml`, a close name beside it, the shipped plan of that name)."""
    from planc.lint.suggest import did_you_mean

    if path.startswith(SHIPPED_PREFIX):
        name, names = path[len(SHIPPED_PREFIX):], shipped_names()
        guess = did_you_mean(name, names)
        return Diagnostic(UNREADABLE, ERROR, f"planc ships no plan named `{name}`",
                          (f"did you mean `planc:{guess}`? " if guess else "")
                          + f"write `planc:NAME` with one of: {', '.join(names)}", Position(path, 1, 1))
    directory, name = os.path.split(path)
    near = [path + s for s in PLAN_SUFFIXES if os.path.isfile(path + s)]
    if not near and name:
        try:
            siblings = [n for n in os.listdir(directory or ".") if n.endswith(PLAN_SUFFIXES) or
                        os.path.isdir(os.path.join(directory or ".", n))]
        except OSError:
            siblings = []
        by_stem = {_stem(n): n for n in siblings}  # the `.yaml` both names end with is no likeness
        close = did_you_mean(_stem(name), by_stem)
        near = [os.path.join(directory, by_stem[close])] if close else []
    shipped = {p.stem: p for p in shipped_plans()}
    close = did_you_mean(_stem(name), shipped)
    if near:
        hint = f"did you mean `{near[0]}`?"
    elif close:
        what = "a plan of that name" if close == _stem(name) else f"`{close}`"
        hint = (f"planc ships {what}: `{shipped[close]}`, `planc:{close}` wherever a plan path goes (`planc lint` "
                f"with no path lints the shipped plans; `extends: planc:{close}` builds on it)")
    elif not os.path.isdir(directory or "."):
        hint = f"directory `{directory}` does not exist either; pass the path of a .yaml plan file"
    else:
        hint = "pass the path of a .yaml plan file (`planc init --from-transformers TYPE -o plan.yaml` writes one)"
    return Diagnostic(UNREADABLE, ERROR, f"no such plan file or directory: `{path}`", hint, Position(path, 1, 1))


def lint_paths(paths: PathsArg, strict: bool = False) -> list[Diagnostic]:
    """Lint files and directories; `strict` reports warnings as errors. Never raises on bad input."""
    return check_paths(paths, strict)[1]


def check_paths(paths: PathsArg, strict: bool = False) -> tuple[list[str], list[Diagnostic]]:
    """`lint_paths`, plus the plan files that were linted (each once): `planc lint` counts them."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    found, diags = expand_paths([os.fspath(p) for p in paths])
    files = list(dict.fromkeys(found))
    for f in files:
        diags += check_file(f).diagnostics
    diags = _unique(diags)
    if strict:
        diags = [dataclasses.replace(d, severity=ERROR) for d in diags]
    return files, diags


def _unique(diags: list[Diagnostic]) -> list[Diagnostic]:
    """Sorted, without repeats (a parent plan's problems are found again through each child)."""
    return sorted(set(diags), key=Diagnostic.sort_key)
