"""The EP runtimes, keyed by the strategy names of `planc.spec.ep` (one registry, like the TP styles')."""

from planc.runtime.ep.all_reduce import AllReduceEPRuntime
from planc.runtime.ep.all_to_all import AllToAllEPRuntime
from planc.runtime.ep.auto import AutoEPRuntime
from planc.runtime.ep.base import EPRuntime
from planc.runtime.ep.megamoe import MegaMoeEPRuntime

EP_RUNTIMES: dict[str, type[EPRuntime]] = {
    "all_to_all": AllToAllEPRuntime,
    "all_reduce": AllReduceEPRuntime,
    "auto": AutoEPRuntime,
    "deepgemm_megamoe": MegaMoeEPRuntime,
}

__all__ = ["EP_RUNTIMES", "EPRuntime", "AllReduceEPRuntime", "AllToAllEPRuntime", "AutoEPRuntime", "MegaMoeEPRuntime"]
