"""EP strategy objects: what the experts of a plan do across the EP group, and why.

`resolve_ep` turns `experts.implementation` + `experts.ep_implementation` into one of these objects, each
carrying its row of `planc.spec.choices.EP_STRATEGIES`.
It is a pure function of the plan, so lint (PLC400-402) and the compiler call the same one. The
objects hold no process group: `explain` prints them, and `planc.apply` binds the runtime registered
under the strategy's `name` (`planc.runtime.ep.EP_RUNTIMES`) with `RuntimeCls(experts_module,
strategy, groups)`. The same classes appear in explain output, in the installed forward
(`module.forward.strategy`) and in docs/ep.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from planc.errors import PlancError
from planc.spec.choices import EP_STRATEGIES, EXPERTS_IMPLEMENTATIONS, EPStrategyRow

if TYPE_CHECKING:
    from planc.spec.model import Experts, Parallel


@dataclass(frozen=True)
class EPStrategy:
    """A named way to run experts sharded over an EP group: its row of `planc.spec.choices.EP_STRATEGIES` and
    why this plan got it. A row without a class of its own below gets this class with its row."""

    reason: str
    row: EPStrategyRow = field(repr=False)

    @property
    def name(self) -> str:
        return self.row.name

    @property
    def needs_shared_batch(self) -> bool:
        """Every rank of the EP group must hold the same batch (ep_size == tp_size)."""
        return self.row.needs_shared_batch

    @property
    def inference_only(self) -> bool:
        """The kernel has no backward: the runtime refuses a forward that needs gradients (planc.runtime.ep.base)."""
        return self.row.inference_only

    def describe(self) -> str:
        return f"{self.row.title}: {self.reason}"

    def to_json(self) -> dict[str, str]:
        return {"strategy": self.row.title, "name": self.name, "reason": self.reason}


@dataclass(frozen=True)
class AllToAllEP(EPStrategy):
    """Only routed tokens move: counts exchange, token all-to-all, local experts, reverse all-to-all."""

    row: EPStrategyRow = field(default=EP_STRATEGIES["all_to_all"], repr=False)


@dataclass(frozen=True)
class AllReduceEP(EPStrategy):
    """Every rank runs its experts over the whole batch (off-rank slots masked), outputs all-reduced."""

    row: EPStrategyRow = field(default=EP_STRATEGIES["all_reduce"], repr=False)


@dataclass(frozen=True)
class MegaMoeEP(EPStrategy):
    """DeepGEMM Mega MoE: equal batch slice per rank, fused dispatch+GEMMs+combine, outputs all-gathered."""

    row: EPStrategyRow = field(default=EP_STRATEGIES["deepgemm_megamoe"], repr=False)


@dataclass(frozen=True)
class AutoEP(EPStrategy):
    """all_reduce when the EP group shares the batch and no gradient flows, else all_to_all (per call)."""

    row: EPStrategyRow = field(default=EP_STRATEGIES["auto"], repr=False)
    shares_batch: bool = True


# the rows with a class of their own (explain and the tests name them); any other row gets EPStrategy
_CLASSES: dict[str, type[EPStrategy]] = {c.row.name: c for c in (AllToAllEP, AllReduceEP, MegaMoeEP, AutoEP)}


def strategy_for(name: str, reason: str, shares_batch: bool = True) -> EPStrategy:
    """The strategy object of the row `name` of EP_STRATEGIES (`shares_batch`: what a `per_call` one records)."""
    if EP_STRATEGIES[name].per_call:
        return AutoEP(reason=reason, row=EP_STRATEGIES[name], shares_batch=shares_batch)
    return _CLASSES.get(name, EPStrategy)(reason=reason, row=EP_STRATEGIES[name])


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
    """Pick the EP strategy object for a plan's experts settings, or raise EPResolutionError.

    Which pairs exclude each other is read from the rows (the pairing table and the JSON Schema are written
    from the same rows): experts with an `ep_strategy` of their own run only under it (or `auto`, which resolves
    to it), a strategy that names its `experts` needs them, and a `per_call` strategy decides on each call.
    """
    impl, ep = experts.implementation, experts.ep_implementation
    kernel, row = EXPERTS_IMPLEMENTATIONS[impl], EP_STRATEGIES[ep]
    shares_batch = parallel.ep_size == parallel.tp_size
    if kernel.ep_strategy is not None:
        own = EP_STRATEGIES[kernel.ep_strategy]
        if ep != own.name and not row.per_call:
            raise EPResolutionError(
                f"experts.implementation `{impl}` runs only with the {own.title} strategy, "
                f"got ep_implementation `{ep}`",
                f"write `ep_implementation: {_per_call_name()}` (or `{own.name}`), or choose other experts",
                "experts.ep_implementation",
                EPResolutionError.MEGAMOE_OTHER_EP,
            )
        strategy = strategy_for(
            own.name,
            f"experts.implementation is {impl}: the fused kernel does its own dispatch and combine"
            if row.per_call
            else f"ep_implementation: {ep}",
        )
    elif row.experts is not None and impl != row.experts:
        raise EPResolutionError(
            f"ep_implementation `{ep}` needs experts.implementation `{row.experts}`, got `{impl}`",
            f"write `implementation: {row.experts}`, or pick `ep_implementation: {_per_call_name()}`",
            "experts.implementation",
            EPResolutionError.MEGAMOE_EP_OTHER_EXPERTS,
        )
    elif row.per_call:
        strategy = strategy_for(
            ep,
            (
                "EP group shares the batch (ep_size == tp_size): all_reduce without gradients, "
                "all_to_all when gradients flow (decided per call)"
            )
            if shares_batch
            else "EP group spans different batches (ep_size != tp_size): always all_to_all",
            shares_batch=shares_batch,
        )
    else:
        strategy = strategy_for(ep, f"ep_implementation: {ep}")
    if strategy.needs_shared_batch and not shares_batch:
        raise EPResolutionError(
            f"{strategy.row.title} needs every rank of the EP group to hold the same batch "
            f"(ep_size == tp_size), got ep_size={parallel.ep_size}, tp_size={parallel.tp_size}",
            # experts that run under their own strategy only: for them only the sizes can change
            "set `ep_size` equal to `tp_size` (Mega MoE needs the EP group to share one batch), or choose other experts"
            if kernel.ep_strategy is not None
            else "set `ep_size` equal to `tp_size`, or use `ep_implementation: all_to_all`",
            "experts.ep_implementation",
            EPResolutionError.SHARED_BATCH,
        )
    return strategy


def _per_call_name() -> str:
    return next(r.name for r in EP_STRATEGIES.values() if r.per_call)
