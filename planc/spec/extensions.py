"""A project's own TP styles and EP strategies: rows registered beside planc's, each with its runtime object.

A registered TP style is a `planc.spec.styles.Style` row and a `planc.runtime.tp_styles.TPStyle` object; a
registered EP strategy is a `planc.spec.choices.EPStrategyRow` and a `planc.runtime.ep.EPRuntime` subclass. Both
halves arrive in one call (`planc.register_tp_style(row, runtime)`, `planc.register_ep_strategy(row, runtime)`)
and this module checks the row: a name of planc's own is refused (registering over `colwise` would silently change
every plan that names it), a second registration of a name must be the same row and runtime, and a row must say
what planc can install. The runtime half is checked against its row by `planc.runtime.extensions`: at once when
the call passes the object, at `planc.apply` when it passes its import path (`"pkg.module:Name"`), and there on the
real TP mesh too (the object shards a probe parameter as the row's placement says).

Trust boundary: a plan names a style or strategy, never code. The code that defines one is the project's own,
imported because the project's config says so: pyproject.toml's `[tool.planc] extensions = ["pkg.module", ...]`
(found from the working directory upward, the way ruff and pytest find theirs; the same trust as the project's
pre-commit config or conftest.py), or imported by the user's own training script. Lint, explain and the language
server import those modules, so a module that registers with an import path rather than an object keeps them
torch-free. No torch here.
"""

from __future__ import annotations

import importlib
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

from planc.errors import PlancError
from planc.spec import styles
from planc.spec.choices import EP_STRATEGIES, EXPERTS_IMPLEMENTATIONS, EPStrategyRow
from planc.spec.styles import REMOVED_STYLES, STYLES, Style

NAME = re.compile(r"[a-z][a-z0-9_]*\Z")
BUILTIN_STYLES = frozenset(s.name for s in STYLES)
BUILTIN_STRATEGIES = frozenset(EP_STRATEGIES)
DOCS = "docs/extending.md"


class ExtensionError(PlancError, ValueError):
    """A registration that planc refuses: what is wrong and what to write instead, in one message."""


@dataclass(frozen=True)
class Extension:
    """One registered row and its runtime half: the object itself, or its import path `"pkg.module:Name"`
    (imported where the plan is applied). `origin`: the module that registered it (for messages)."""

    kind: Literal["TP style", "EP strategy"]
    row: Union[Style, EPStrategyRow]
    runtime: Any
    origin: str

    @property
    def name(self) -> str:
        return self.row.name

    @property
    def runtime_ref(self) -> str:
        """The runtime half as an import path (how messages and rank agreement name it)."""
        if isinstance(self.runtime, str):
            return self.runtime
        obj = self.runtime if isinstance(self.runtime, type) else type(self.runtime)
        return f"{obj.__module__}:{obj.__qualname__}"

    def describe(self) -> str:
        """What every rank must agree on: the kind, the whole row and the runtime's import path."""
        return f"{self.kind} {self.row!r}, runtime {self.runtime_ref}"


EXTENSIONS: dict[str, Extension] = {}


Check = Optional[Callable[[Extension, Any], None]]


def register_tp_style(row: Style, runtime: Any, *, origin: str, check: Check = None) -> Extension:
    """Add `row` to the style table with its runtime half; `check(extension, runtime)` raises when the runtime
    object contradicts the row (planc.runtime.extensions.check_runtime; None for an import path)."""
    if not isinstance(row, Style):
        raise ExtensionError(f"planc.register_tp_style: the row must be a planc.spec.styles.Style, got "
                             f"{type(row).__name__}. Write `Style(\"my_style\", \"tp\", \"module\", \"what it does\", ...)`.")
    _check_name(row.name, BUILTIN_STYLES | set(REMOVED_STYLES), "style", "styles", "planc.register_tp_style")
    problems = tp_row_problems(row)
    if problems:
        raise ExtensionError(f"planc.register_tp_style: the row of `{row.name}` cannot be installed: "
                             + "; ".join(problems))
    ext = _record(Extension("TP style", row, runtime, origin), "planc.register_tp_style", check)
    styles.add_style(row)
    return ext


def register_ep_strategy(row: EPStrategyRow, runtime: Any, *, origin: str, check: Check = None) -> Extension:
    """Add `row` to EP_STRATEGIES with its runtime half, checked as in `register_tp_style`."""
    if not isinstance(row, EPStrategyRow):
        raise ExtensionError(f"planc.register_ep_strategy: the row must be a planc.spec.choices.EPStrategyRow, got "
                             f"{type(row).__name__}. Write `EPStrategyRow(\"my_ep\", \"MyEP\", \"what it does\")`.")
    _check_name(row.name, BUILTIN_STRATEGIES, "EP strategy", "EP strategies", "planc.register_ep_strategy")
    problems = ep_row_problems(row)
    if problems:
        raise ExtensionError(f"planc.register_ep_strategy: the row of `{row.name}` cannot be installed: "
                             + "; ".join(problems))
    ext = _record(Extension("EP strategy", row, runtime, origin), "planc.register_ep_strategy", check)
    EP_STRATEGIES[row.name] = row
    return ext


def unregister(name: str) -> None:
    """Drop a registered style or strategy (tests; planc's own rows cannot be dropped)."""
    ext = EXTENSIONS.pop(name, None)
    if ext is None:
        return
    if ext.kind == "TP style":
        styles.remove_style(name)
    else:
        EP_STRATEGIES.pop(name, None)


def tp_row_problems(row: Style) -> list[str]:
    """What keeps a TP style row from being installed as a registered style (empty: none)."""
    out = []
    if row.section != "tp":
        out.append(f"section is `{row.section}`; a registered style goes in tp_plan (section \"tp\"), and an "
                   "expert-parallel variant is an EP strategy (planc.register_ep_strategy)")
    if not row.runtime:
        out.append("runtime=False: the compiler refuses styles planc does not install (PLC605); a registered style "
                   "comes with its runtime object, so write runtime=True")
    if row.experts_mode is not None:
        out.append("experts_mode is set: experts modules are hooked by planc's own styles (`ep_dispatch_experts`, "
                   "`moe_tp_experts`); register an EP strategy for experts instead")
    if row.mesh != "tp":
        out.append("mesh is \"ep\": a TP style splits over the TP group; write mesh=\"tp\"")
    if row.target == "parameter" and (row.input is not None or row.output is not None):
        out.append("a parameter style has no activation layouts; drop input/output or make it a module style")
    if row.packed and row.dims == (None, None):
        out.append("packed=True with dims=(None, None): a packed style splits a dim; give dims")
    if row.target not in ("module", "parameter"):
        out.append(f"target `{row.target}` is neither \"module\" nor \"parameter\"")
    return out


def ep_row_problems(row: EPStrategyRow) -> list[str]:
    """What keeps an EP strategy row from being installed as a registered strategy (empty: none)."""
    out = []
    if row.per_call:
        out.append("per_call=True: choosing a strategy on each call is planc's `auto`; a registered strategy is one "
                   "exchange, so write per_call=False")
    titles = {r.title for n, r in EP_STRATEGIES.items() if n != row.name}
    if row.title in titles:
        out.append(f"title `{row.title}` is another strategy's (explain prints it); pick a title of its own")
    if row.experts is not None:
        kernel = EXPERTS_IMPLEMENTATIONS.get(row.experts)
        if kernel is None:
            out.append(f"experts `{row.experts}` is not an experts implementation; pick one of "
                       f"{', '.join(EXPERTS_IMPLEMENTATIONS)} or None")
        elif kernel.ep_strategy is not None:
            out.append(f"experts `{row.experts}` run only under their own strategy `{kernel.ep_strategy}`")
    return out


def _check_name(name: Any, builtin: frozenset[str] | set[str], noun: str, nouns: str, caller: str) -> None:
    if not isinstance(name, str) or not NAME.match(name):
        raise ExtensionError(f"{caller}: the name {name!r} is not a {noun} name; write lowercase letters, digits "
                             "and underscores, starting with a letter (e.g. `colwise_scaled`)")
    if name in builtin:
        raise ExtensionError(
            f"{caller}: `{name}` is one of planc's own {nouns}; registering over it would change every plan that "
            f"names it. Register yours under a name of its own (e.g. `{name}_custom`) and write that in the plan.")


def _record(ext: Extension, caller: str, check: Check) -> Extension:
    """Keep `ext` once its runtime passed `check`; registering the same row and runtime again (a module imported
    twice) is a no-op."""
    if check is not None:
        check(ext, ext.runtime)
    old = EXTENSIONS.get(ext.name)
    if old is not None:
        if old.describe() == ext.describe():
            return old
        raise ExtensionError(
            f"{caller}: `{ext.name}` is already registered by {old.origin} as {old.describe()}; a name has one "
            f"meaning. Register this one ({ext.describe()}) under another name, or drop one of the two calls.")
    EXTENSIONS[ext.name] = ext
    return ext


def snapshot() -> tuple[tuple[str, Union[Style, EPStrategyRow], str, str], ...]:
    """Every registration as picklable data (kind, row, runtime import path, origin): what a spawned rank needs to
    register the same (planc.runtime.local_world passes it to every rank it starts)."""
    return tuple((e.kind, e.row, e.runtime_ref, e.origin) for e in EXTENSIONS.values())


def restore(registered: tuple[tuple[str, Union[Style, EPStrategyRow], str, str], ...]) -> None:
    """Register what `snapshot` gave (in a spawned rank); the runtimes are imported and checked where applied."""
    for _kind, row, runtime, origin in registered:
        if isinstance(row, Style):
            register_tp_style(row, runtime, origin=origin)
        else:
            register_ep_strategy(row, runtime, origin=origin)


def snapshot_data() -> list[dict[str, Any]]:
    """`snapshot` as JSON data (a child process started with a command line: `planc verify --memory`)."""
    return [{"kind": kind, "row": asdict(row), "runtime": ref, "origin": origin} for kind, row, ref, origin in snapshot()]


def restore_data(data: list[dict[str, Any]]) -> None:
    """Register what `snapshot_data` gave."""
    restore(tuple(
        (d["kind"], Style(**{**d["row"], "dims": tuple(d["row"]["dims"])}) if d["kind"] == "TP style"
         else EPStrategyRow(**d["row"]), d["runtime"], d["origin"]) for d in data))


def registry_summary() -> dict[str, str]:
    """name -> what was registered, sorted: what every rank must agree on before it loads a plan."""
    return {name: EXTENSIONS[name].describe() for name in sorted(EXTENSIONS)}


# ---- the project's config: pyproject.toml [tool.planc] extensions ------------------------------------------


@dataclass(frozen=True)
class ConfigProblem:
    """A module the project's config names that could not be imported: where the config says so."""

    message: str
    hint: str
    path: str
    line: int
    col: int


_LOADED: dict[str, list[ConfigProblem]] = {}


def find_project_config(start: Optional[Path] = None) -> Optional[Path]:
    """The nearest pyproject.toml from `start` (default: the working directory) upward with a [tool.planc] table."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            try:
                text = candidate.read_text(encoding="utf-8")
            except OSError:
                continue
            if re.search(r"^\s*\[tool\.planc\]", text, re.M):
                return candidate
    return None


def load_project_extensions(start: Optional[Path] = None) -> list[ConfigProblem]:
    """Import the modules pyproject.toml's `[tool.planc] extensions` names (once per config file); their problems.

    The config's folder is put first on sys.path while they import, so a checkout's own package is found without
    being installed (pre-commit runs from the repository root)."""
    config = find_project_config(start)
    if config is None:
        return []
    key = str(config)
    if key in _LOADED:
        return _LOADED[key]
    text = config.read_text(encoding="utf-8")
    line = next((i for i, t in enumerate(text.splitlines(), 1) if re.match(r"\s*extensions\s*=", t)), 1)
    problems: list[ConfigProblem] = []
    try:
        table = _toml_loads(text).get("tool", {}).get("planc", {})
    except Exception as e:  # noqa: BLE001 - tomllib's TOMLDecodeError, or no TOML reader on Python 3.10
        problems.append(ConfigProblem(f"pyproject.toml cannot be read: {type(e).__name__}: {e}",
                                      "fix the file (on Python 3.10, install `tomli`)", key, 1, 1))
        table = {}
    names = table.get("extensions", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        problems.append(ConfigProblem("[tool.planc] extensions must be a list of module names",
                                      'write `extensions = ["myproject.planc_styles"]`', key, line, 1))
        names = []
    sys.path.insert(0, str(config.parent))
    try:
        for name in names:
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - the project's module failed: reported where the config names it
                problems.append(ConfigProblem(
                    f"[tool.planc] extensions: module `{name}` failed to import: {type(e).__name__}: {e}",
                    f"fix `{name}` (it registers the project's styles and strategies) or drop it from the list; "
                    f"see {DOCS}", key, line, 1))
    finally:
        sys.path.remove(str(config.parent))
    _LOADED[key] = problems
    return problems


def _toml_loads(text: str) -> dict[str, Any]:
    """tomllib (Python 3.11+), else the `tomli` package it came from."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]
    loaded: dict[str, Any] = tomllib.loads(text)
    return loaded


__all__ = ["Extension", "ExtensionError", "EXTENSIONS", "register_tp_style", "register_ep_strategy", "unregister",
           "registry_summary", "snapshot", "restore", "snapshot_data", "restore_data", "load_project_extensions", "find_project_config", "ConfigProblem"]
