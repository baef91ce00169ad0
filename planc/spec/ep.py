"""EP strategy objects: what the experts of a plan do across the EP group, and why.

`resolve_ep` turns `experts.implementation` + `experts.ep_implementation` into one of these objects.
It is a pure function of the plan, so lint (PLC400-402) and the compiler call the same one. The
objects hold no process group: `explain` prints them, and `planc.apply` binds the runtime registered
under the strategy's `name` (`planc.runtime.ep.EP_RUNTIMES`) with `RuntimeCls(experts_module,
strategy, groups)`. The same classes appear in explain output, in the installed forward
(`module.forward.strategy`) and in docs/ep.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from planc.errors import PlancError
from planc.spec.model import Experts, Parallel
from planc.spec.pairings import MEGAMOE_EP_EXPERTS, MEGAMOE_EXPERTS_EP


@dataclass(frozen=True)
class EPStrategy:
    """Base: a named way to run experts sharded over an EP group."""

    reason: str

    name: ClassVar[str] = ""
    # Every rank of the EP group must hold the same batch (ep_size == tp_size).
    needs_shared_batch: ClassVar[bool] = False
    # The kernel has no backward: the runtime refuses a forward that needs gradients (planc.runtime.ep.base).
    inference_only: ClassVar[bool] = False

    def describe(self) -> str:
        return f"{type(self).__name__}: {self.reason}"

    def to_json(self) -> dict[str, str]:
        return {"strategy": type(self).__name__, "name": self.name, "reason": self.reason}


@dataclass(frozen=True)
class AllToAllEP(EPStrategy):
    """Only routed tokens move: counts exchange, token all-to-all, local experts, reverse all-to-all."""

    name: ClassVar[str] = "all_to_all"


@dataclass(frozen=True)
class AllReduceEP(EPStrategy):
    """Every rank runs its experts over the whole batch (off-rank slots masked), outputs all-reduced."""

    name: ClassVar[str] = "all_reduce"
    needs_shared_batch: ClassVar[bool] = True


@dataclass(frozen=True)
class MegaMoeEP(EPStrategy):
    """DeepGEMM Mega MoE: equal batch slice per rank, fused dispatch+GEMMs+combine, outputs all-gathered."""

    name: ClassVar[str] = "deepgemm_megamoe"
    needs_shared_batch: ClassVar[bool] = True
    inference_only: ClassVar[bool] = True


@dataclass(frozen=True)
class AutoEP(EPStrategy):
    """all_reduce when the EP group shares the batch and no gradient flows, else all_to_all (per call)."""

    name: ClassVar[str] = "auto"
    shares_batch: bool = True


class EPResolutionError(PlancError, ValueError):
    """The experts implementation and the EP implementation cannot be combined."""

    # What went wrong, so the linter can give each case its own stable code.
    MEGAMOE_OTHER_EP = "megamoe_other_ep"  # Mega MoE experts with another ep_implementation
    MEGAMOE_EP_OTHER_EXPERTS = "megamoe_ep_other_experts"  # MegaMoeEP with other experts
    SHARED_BATCH = "shared_batch"  # a strategy that needs ep_size == tp_size

    def __init__(self, message: str, hint: str, field: str, kind: str):
        super().__init__(message)
        self.hint = hint
        self.field = field
        self.kind = kind


def resolve_ep(experts: Experts, parallel: Parallel) -> EPStrategy:
    """Pick the EP strategy object for a plan's experts settings, or raise EPResolutionError."""
    impl, ep = experts.implementation, experts.ep_implementation
    shares_batch = parallel.ep_size == parallel.tp_size
    # which pairs exclude each other is the pairing table's (the JSON Schema is written from it too)
    if impl == MEGAMOE_EXPERTS_EP.value:
        if ep not in MEGAMOE_EXPERTS_EP.allowed:
            raise EPResolutionError(
                f"experts.implementation `deepgemm_megamoe` runs only with the MegaMoeEP strategy, "
                f"got ep_implementation `{ep}`",
                "write `ep_implementation: auto` (or `deepgemm_megamoe`), or choose other experts",
                ".".join(MEGAMOE_EXPERTS_EP.key),
                EPResolutionError.MEGAMOE_OTHER_EP,
            )
        strategy: EPStrategy = MegaMoeEP(
            reason="experts.implementation is deepgemm_megamoe: the fused kernel does its own dispatch and combine"
            if ep == "auto"
            else "ep_implementation: deepgemm_megamoe"
        )
    elif ep == MEGAMOE_EP_EXPERTS.value and impl not in MEGAMOE_EP_EXPERTS.allowed:
        raise EPResolutionError(
            f"ep_implementation `deepgemm_megamoe` needs experts.implementation `deepgemm_megamoe`, got `{impl}`",
            "write `implementation: deepgemm_megamoe`, or pick `ep_implementation: auto`",
            ".".join(MEGAMOE_EP_EXPERTS.key),
            EPResolutionError.MEGAMOE_EP_OTHER_EXPERTS,
        )
    elif ep == "all_to_all":
        strategy = AllToAllEP(reason="ep_implementation: all_to_all")
    elif ep == "all_reduce":
        strategy = AllReduceEP(reason="ep_implementation: all_reduce")
    else:
        strategy = AutoEP(
            reason=(
                "EP group shares the batch (ep_size == tp_size): all_reduce without gradients, "
                "all_to_all when gradients flow (decided per call)"
            )
            if shares_batch
            else "EP group spans different batches (ep_size != tp_size): always all_to_all",
            shares_batch=shares_batch,
        )
    if strategy.needs_shared_batch and not shares_batch:
        raise EPResolutionError(
            f"{type(strategy).__name__} needs every rank of the EP group to hold the same batch "
            f"(ep_size == tp_size), got ep_size={parallel.ep_size}, tp_size={parallel.tp_size}",
            # Mega MoE experts run only behind MegaMoeEP: for them only the sizes can change.
            "set `ep_size` equal to `tp_size` (Mega MoE needs the EP group to share one batch), or choose other experts"
            if isinstance(strategy, MegaMoeEP)
            else "set `ep_size` equal to `tp_size`, or use `ep_implementation: all_to_all`",
            "experts.ep_implementation",
            EPResolutionError.SHARED_BATCH,
        )
    return strategy
