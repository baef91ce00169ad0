"""Resolution of a plan against a model: pure, inspectable, changes nothing. No torch import here."""

from typing import Any

from planc.spec.ep import AllReduceEP, AllToAllEP, AutoEP, EPStrategy, MegaMoeEP, resolve_ep

__all__ = ["AllReduceEP", "AllToAllEP", "AutoEP", "EPStrategy", "MegaMoeEP", "resolve_ep", "compile_plan"]


def __getattr__(name: str) -> Any:
    if name == "compile_plan":
        from planc.compiler.resolve import compile_plan

        return compile_plan
    raise AttributeError(name)
