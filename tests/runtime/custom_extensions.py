"""A project's own TP style and EP strategy, as a team would write them (the tests register them through
`planc.register_tp_style` / `planc.register_ep_strategy`).

`colwise_traced`: colwise whose forward counts its calls (a colwise variant: the row is colwise's placement and
layouts under another name). `all_to_all_counted`: all_to_all's exchange, counting its calls. The rows are pure
data; `ROWS_MODULE` is the torch-free module a project names in pyproject.toml's [tool.planc] extensions.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from planc.runtime.ep.all_to_all import AllToAllEPRuntime
from planc.runtime.tp_styles import Colwise
from tests.runtime.custom_rows import COUNTED_ALL_TO_ALL, TRACED_COLWISE


class TracedColwise(Colwise):
    """colwise, counting the forwards it runs (one counter per process)."""

    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.name = TRACED_COLWISE.name

    def install(self, module: nn.Module, mesh: DeviceMesh) -> None:
        super().install(module, mesh)
        sharded = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            type(self).calls += 1
            return sharded(*args, **kwargs)

        forward.planc_style = self.name  # type: ignore[attr-defined]
        module.forward = forward


class CountedAllToAll(AllToAllEPRuntime):
    """all_to_all's exchange, counting its calls."""

    calls = 0

    def forward(self, hidden_states, top_k_index, top_k_weights):
        type(self).calls += 1
        return super().forward(hidden_states, top_k_index, top_k_weights)


def register() -> None:
    """Both extensions, their runtime halves as objects (the training script's way)."""
    import planc

    planc.register_tp_style(TRACED_COLWISE, TracedColwise())
    planc.register_ep_strategy(COUNTED_ALL_TO_ALL, CountedAllToAll)
