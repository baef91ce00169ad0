"""Imports flow one way, without exceptions, and never in a circle.

Layers: spec -> lint -> compiler -> kernels and models (runtime-level: torch, transformers; below the
runtime) -> runtime -> checkpoint (load/save/export drive the runtime's install) -> verification (runs the runtime and
checkpoints against an unsharded twin) -> commands, the CLI and
the public API (`planc/__init__.py`). Every
`import planc`, `import planc.X` and `from planc.X import ...` in the package (module level or inside a
function: a lazy import is still a dependency) must name the same layer or one listed before it; the
kernels know nothing of plans or modules and import only `planc.errors` and `planc.spec`.

Cycles: the module graph of planc (an import of `planc.x` is an edge to `planc.x`; `from planc.x import
name` is an edge to `planc.x.name` when that is a module, else to `planc.x`) has no cycle. Lazy imports
count; imports under `if TYPE_CHECKING:` (annotations only, never run) do not.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "planc"
# The package under `planc.` -> its layer; a module may import its own layer and the ones below.
LAYERS = {"errors": 0, "version": 0, "spec": 0, "lint": 1, "compiler": 2, "kernels": 3, "models": 3, "runtime": 4,
          "checkpoint": 5, "verification": 6, "commands": 7, "cli": 7, "__main__": 7, "__init__": 7}
# Layers that may import only these packages of the lower ones: the kernels know nothing of plans.
ONLY = {"kernels": {"errors", "spec", "kernels"}}


@cache
def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, `planc` for planc/__init__.py)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, path: Path, *, type_checking: bool):
    """(line, imported planc module or package) for every import in `path`, lazy ones included; relative imports
    resolved; `from planc.x import name` gives `planc.x.name` when that is a module, else `planc.x`."""
    known = _modules()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node):
        if isinstance(node, ast.If) and not type_checking and _is_type_checking(node):
            yield from (n for child in node.orelse for n in visit(child))
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "planc" or a.name.startswith("planc."):
                    yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            if base == "planc" or base.startswith("planc."):
                for a in node.names:
                    yield node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
        for child in ast.iter_child_nodes(node):
            yield from visit(child)

    yield from visit(ast.parse(path.read_text(), str(path)))


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"  # `import planc`, `from planc import apply`: the public API


def _layer(module: str) -> int:
    package = _package(module)
    assert package in LAYERS, f"{module}: planc.{package} has no layer; add it to LAYERS"
    return LAYERS[package]


def test_imports_flow_one_way():
    bad = []
    for module, path in _modules().items():
        if module == "planc":
            continue
        mine, allowed = _layer(module), ONLY.get(_package(module))
        for line, target in _imports(module, path, type_checking=True):
            if _layer(target) > mine or (allowed is not None and _package(target) not in allowed):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {module} imports {target}")
    assert bad == [], "imports against the layer order:\n" + "\n".join(bad)


def test_the_layer_check_sees_every_kind_of_import(tmp_path):
    """A bare `import planc`, `from planc import x`, a relative import and a lazy one are all seen."""
    text = ("import planc\nfrom planc import apply\nfrom ..commands import demo\n"
            "def f():\n    from planc.cli import main\n"
            "if TYPE_CHECKING:\n    from planc.commands import lint\n")
    fake = tmp_path / "install.py"  # read as planc.runtime.install, so that the relative import resolves
    fake.write_text(text)
    got = {t for _, t in _imports("planc.runtime.install", fake, type_checking=True)}
    assert got == {"planc", "planc.commands.demo", "planc.cli", "planc.commands.lint"}
    assert [_layer(t) > LAYERS["runtime"] for t in sorted(got)] == [True] * 4
    assert "planc.commands.lint" not in {t for _, t in _imports("planc.runtime.install", fake, type_checking=False)}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    modules = _modules()
    graph = {m: {t for _, t in _imports(m, p, type_checking=False) if t in modules and t != m}
             for m, p in modules.items()}
    cycles = _cycles(graph)
    described = [" <-> ".join(c) + "\n    " + "\n    ".join(f"{m} -> {', '.join(sorted(graph[m] & set(c)))}" for m in c)
                 for c in cycles]
    assert cycles == [], "import cycles inside planc:\n" + "\n".join(described)


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_planc_exception_is_a_plancerror():
    import importlib
    import inspect
    import pkgutil

    import planc
    from planc.errors import PlancError

    outside = []
    for info in pkgutil.walk_packages(planc.__path__, "planc."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name:
                if not issubclass(obj, PlancError):
                    outside.append(f"{info.name}.{name}")
    assert outside == []
