"""Imports flow one way: spec -> lint -> compiler -> kernels -> runtime/checkpoint -> commands/cli and the public API.

Every `import planc.X` and `from planc.X import ...` in the package (module level or inside a
function: a lazy import is still a dependency) must name the same layer or one listed before it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "planc"
LAYERS = {"errors": 0, "spec": 0, "lint": 1, "compiler": 2, "kernels": 3, "runtime": 4, "checkpoint": 4, "commands": 5,
          "cli": 5, "__main__": 5, "__init__": 5}
# Layers that may import only these packages of the lower ones: the kernels know nothing of plans.
ONLY = {"kernels": {"errors", "spec", "kernels"}}


# Modules that sit in a lower package but drive the whole stack, as the CLI does: the family sweep runs
# `planc init` -> lint -> explain -> `planc.apply` for every family (it is a tool over the public API).
DRIVERS = {"planc.runtime.family_sweep": 5}


def _layer(module: str) -> int:
    if module in DRIVERS:
        return DRIVERS[module]
    parts = module.split(".")
    return LAYERS.get(parts[1] if len(parts) > 1 else "__init__", LAYERS["__init__"])  # `from planc import apply`


def _imports(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("planc."):
                    yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("planc"):
            if node.module == "planc":
                for a in node.names:
                    yield node.lineno, f"planc.{a.name}"
            else:
                yield node.lineno, node.module


def test_imports_flow_one_way():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts)
        if module.endswith(".__init__"):
            module = module[: -len(".__init__")]
        if module == "planc":
            continue
        mine = _layer(module)
        for line, target in _imports(path):
            allowed = ONLY.get(module.split(".")[1])
            if _layer(target) > mine or (allowed is not None and target.split(".")[1] not in allowed):
                bad.append(f"{rel}.py:{line}: {module} imports {target}")
    assert bad == [], "imports against the layer order:\n" + "\n".join(bad)


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
