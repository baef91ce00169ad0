"""The rows of tests/runtime/custom_extensions.py, registered with their runtimes' import paths: torch-free, the
module a project names in pyproject.toml's `[tool.planc] extensions` so that `planc lint` knows the names."""

from __future__ import annotations

from planc.spec.choices import EPStrategyRow
from planc.spec.styles import REPLICATED, SHARDED, Style

TRACED_COLWISE = Style("colwise_traced", "tp", "module", "colwise that counts its forwards (a project's own style)",
                       dims=(-2, 0), input=REPLICATED, output=SHARDED, runtime=True, local_forward=True)
COUNTED_ALL_TO_ALL = EPStrategyRow("all_to_all_counted", "CountedAllToAllEP",
                                   "all_to_all that counts its calls (a project's own strategy)")


def register() -> None:
    import planc

    planc.register_tp_style(TRACED_COLWISE, "tests.runtime.custom_extensions:TracedColwise")
    planc.register_ep_strategy(COUNTED_ALL_TO_ALL, "tests.runtime.custom_extensions:CountedAllToAll")
