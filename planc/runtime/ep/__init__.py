"""The EP runtimes, keyed by the rows of `planc.spec.choices.EP_STRATEGIES` (one registry, like the TP styles')."""

from planc.runtime.ep.all_reduce import AllReduceEPRuntime
from planc.runtime.ep.all_to_all import AllToAllEPRuntime
from planc.runtime.ep.auto import AutoEPRuntime
from planc.runtime.ep.base import EPRuntime
from planc.runtime.ep.megamoe import MegaMoeEPRuntime
from planc.spec.choices import EP_STRATEGIES
from planc.spec.extensions import EXTENSIONS

EP_RUNTIMES: dict[str, type[EPRuntime]] = {
    "all_to_all": AllToAllEPRuntime,
    "all_reduce": AllReduceEPRuntime,
    "auto": AutoEPRuntime,
    "deepgemm_megamoe": MegaMoeEPRuntime,
}


def _check_registry() -> None:
    """Fail at import if the registry and planc's own rows drift apart (a strategy row with no runtime, or the
    reverse). A registered strategy's runtime is checked when it is registered (planc.runtime.extensions)."""
    own = set(EP_STRATEGIES) - set(EXTENSIONS)
    if set(EP_RUNTIMES) != own:
        raise ImportError(
            f"planc.runtime.ep: EP runtimes {sorted(set(EP_RUNTIMES) ^ own)} differ from "
            "planc.spec.choices.EP_STRATEGIES; add the runtime object or the row"
        )


_check_registry()

__all__ = ["EP_RUNTIMES", "EPRuntime", "AllReduceEPRuntime", "AllToAllEPRuntime", "AutoEPRuntime", "MegaMoeEPRuntime"]
