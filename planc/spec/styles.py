"""The style vocabulary: one row per style, in transformers' current (>= 5.23) names.

Every part of planc that needs to know what a style means reads its row here: lint (which table,
removed, unknown), the compiler (target kind, bytes per rank, uneven shards, the layout pass) and
the runtime (its registry is keyed by these names, and `tests/runtime` checks that each runtime
style shards exactly as its row says). Adding a style is adding one row (and, for the runtime, one
object in `planc.runtime.tp_styles`). No torch here: placements are plain dims.

Modelled on torch's `distributed/tensor/parallel/style.py`: a style knows how it partitions a
parameter (`placement`) and which activation layout its module takes and gives (`input`, `output`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

# Activation layouts at a module boundary (the last dim, features, is the one TP splits).
Layout = Literal["replicated", "sharded"]
REPLICATED: Layout = "replicated"  # every rank holds the whole tensor
SHARDED: Layout = "sharded"  # each rank holds its slice of the last dim (e.g. its attention heads)


@dataclass(frozen=True)
class Style:
    """One style: where it goes, what it does to a parameter, and the layouts its module sees.

    `dims`: the dim split for a parameter with 2 or more dims, and for a 1-D one (a bias); None keeps
    it whole. `packed`: the split dim holds two halves ([gate | up]) that are split separately.
    `input`/`output`: the activation layout the module expects and produces once the style is
    installed (None: not a module style, or it keeps whatever it gets). `runtime`: planc installs it.
    """

    name: str
    section: Literal["tp", "ep"]  # the plan table it belongs to
    target: Literal["module", "parameter"]  # a module style also covers the module's own parameters
    doc: str
    dims: tuple[Optional[int], Optional[int]] = (None, None)
    packed: bool = False
    mesh: Literal["tp", "ep"] = "tp"  # the group a split parameter is split over
    input: Optional[Layout] = None
    output: Optional[Layout] = None
    runtime: bool = False
    experts_mode: Optional[Literal["ep", "tp"]] = None  # a style that hooks an experts module's forward
    # the installed forward runs the module on the local shards of its own parameters, so a bare parameter of
    # the module (attention sinks, [n, I, H] shared experts) may be sharded (compiler check PLC621)
    local_forward: bool = False
    # a LoRA adapter on a linear of this style (`planc.distribute_adapters`): whole on every rank, or split as the
    # base layer is (`lora_B`: its rows, the base's output features; `lora_A`: its columns, the input features);
    # None: adapters cannot follow this style
    lora: Optional[Literal["whole", "lora_B", "lora_A"]] = None
    # the gradients the style all-reduces over the TP group in backward, for parameters it keeps whole whose users
    # run on each rank's heads only (their local gradient is partial): all of the module's parameters' (a per-head
    # q_norm), or the rope slice of MLA's kv_a_proj_with_mqa output; None: no gradient is reduced (compiler PLC636)
    grad_allreduce: Optional[Literal["all", "mla_rope"]] = None

    def placement(self, ndim: int) -> Optional[int]:
        """The dim split for a parameter of `ndim` dims, or None when it stays whole on every rank."""
        if ndim == 0:
            return None
        return self.dims[0] if ndim >= 2 else self.dims[1]

    @property
    def shards(self) -> bool:
        """Whether the style splits any parameter."""
        return self.dims != (None, None)

    @property
    def by_expert(self) -> bool:
        """Whether the style splits a parameter by expert (its leading dim over the EP group)."""
        return self.mesh == "ep" and self.shards


R, S = REPLICATED, SHARDED

STYLES: tuple[Style, ...] = (
    Style("colwise", "tp", "module", "shard the output features (weight dim -2); output stays sharded",
          dims=(-2, 0), input=R, output=S, runtime=True, local_forward=True, lora="lora_B"),
    Style("colwise_gather_output", "tp", "module", "colwise, output all-gathered (lm_head)",
          dims=(-2, 0), input=R, output=R, runtime=True, local_forward=True, lora="whole"),
    Style("rowwise", "tp", "module", "shard the input features (weight dim -1); output all-reduced",
          dims=(-1, None), input=S, output=R, runtime=True, local_forward=True, lora="lora_A"),
    Style("rowwise_split_input", "tp", "module", "rowwise that slices a replicated input itself",
          dims=(-1, None), input=R, output=R, runtime=True, local_forward=True, lora="whole"),
    Style("packed_colwise", "tp", "module", "colwise for fused gate|up weights (each half sharded separately)",
          dims=(-2, -1), packed=True, input=R, output=S, runtime=True, local_forward=True),
    Style("packed_rowwise", "tp", "parameter", "rowwise for weights packed on the last dim",
          dims=(-1, None), packed=True, runtime=True),
    Style("embedding_rowwise", "tp", "module", "vocab-parallel embedding, partial lookups summed",
          dims=(0, 0), input=R, output=R, runtime=True, local_forward=True),
    Style("embedding_colwise", "tp", "module", "hidden-dim sharded embedding, gathered",
          dims=(1, 0), input=R, output=R),
    Style("sequence_parallel", "tp", "module", "replicated params, activations sharded on the sequence dim"),
    # transformers 5.25: colwise / rowwise over a 2-D mesh whose units (KV heads fewer than the TP size) several
    # ranks hold alike; not installed, but their layouts keep the chains transformers declares with them (PLC634)
    Style("unit_colwise", "tp", "module", "colwise in units that several ranks may share (KV heads < tp_size)",
          dims=(-2, 0), input=R, output=S),
    Style("unit_rowwise", "tp", "module", "rowwise in units that several ranks may share (KV heads < tp_size)",
          dims=(-1, None), input=S, output=R),
    Style("replicated_with_grad_allreduce", "tp", "module", "replicated params whose gradients are all-reduced",
          runtime=True, grad_allreduce="all"),
    Style("mla_kv_a_proj", "tp", "module", "MLA kv_a_proj_with_mqa: rope slice all-reduced in backward",
          runtime=True, grad_allreduce="mla_rope"),
    Style("all_reduce", "tp", "module", "run the module on its sharded bare parameters, all-reduce its partial output",
          input=R, output=R, runtime=True, local_forward=True),
    Style("moe_tp_experts", "tp", "module", "tensor-parallel experts (each rank a slice of every expert)",
          input=R, output=R, runtime=True, experts_mode="tp", local_forward=True),
    Style("moe_identity_expert", "tp", "module", "identity expert input divided by the TP size", runtime=True),
    Style("local_params", "tp", "module", "run the module on the local shards of its bare parameters "
          "(per-head attention sinks); its children reduce the output", runtime=True, local_forward=True),
    Style("replicate", "tp", "module", "every rank keeps the full parameter", runtime=True, lora="whole"),
    Style("grouped_gemm", "ep", "parameter", "shard the expert dimension of an experts parameter over the EP group",
          dims=(0, 0), mesh="ep", runtime=True),
    Style("ep_dispatch_experts", "ep", "module", "replace the experts forward with the plan's EP implementation",
          input=R, output=R, runtime=True, experts_mode="ep", local_forward=True),
)

# Every view below holds planc's own rows and the rows a project registered (`planc.register_tp_style`, through
# `add_style`): the views are filled in place, so a module that imported one sees a registered row at once.
STYLE: dict[str, Style] = {}
# Name -> one-line doc views of the table, for lint messages and `planc rules`.
TP_STYLES: dict[str, str] = {}
EP_STYLES: dict[str, str] = {}
# Every current style name. Which table takes which is checked by the lint style rules (PLC311,
# PLC312): EP styles and `replicate` in ep_plan, TP styles in tp_plan.
ALL_STYLES: dict[str, str] = {}
EP_TABLE_STYLES: set[str] = set()
# The styles each rule table takes, sorted, each with its doc: the lint hints and the JSON Schema's per-table
# enums (completion and hover in editors) read this one view.
TABLE_STYLES: dict[str, dict[str, str]] = {"tp_plan": {}, "ep_plan": {}}
# Styles whose target is a parameter rather than a module.
PARAMETER_STYLES: set[str] = set()
# The styles planc's runtime installs. The compiler refuses the others instead of skipping them.
RUNTIME_STYLES: set[str] = set()
# Module styles that hook an experts module: style -> experts mode.
EXPERTS_MODULE_STYLES: dict[str, Literal["ep", "tp"]] = {}


def _fill_views(rows: tuple[Style, ...]) -> None:
    """Rebuild every view from `rows` (planc's own, then the registered ones), in place."""
    for view in (STYLE, TP_STYLES, EP_STYLES, ALL_STYLES, EP_TABLE_STYLES, PARAMETER_STYLES, RUNTIME_STYLES,
                 EXPERTS_MODULE_STYLES):
        view.clear()
    STYLE.update({s.name: s for s in rows})
    TP_STYLES.update({s.name: s.doc for s in rows if s.section == "tp"})
    EP_STYLES.update({s.name: s.doc for s in rows if s.section == "ep"})
    ALL_STYLES.update({**TP_STYLES, **EP_STYLES})
    EP_TABLE_STYLES.update(set(EP_STYLES) | {"replicate"})
    for table, names in (("tp_plan", TP_STYLES), ("ep_plan", EP_TABLE_STYLES)):
        TABLE_STYLES[table].clear()
        TABLE_STYLES[table].update({name: ALL_STYLES[name] for name in sorted(names)})
    PARAMETER_STYLES.update(s.name for s in rows if s.target == "parameter")
    RUNTIME_STYLES.update(s.name for s in rows if s.runtime)
    EXPERTS_MODULE_STYLES.update({s.name: s.experts_mode for s in rows if s.experts_mode})


_REGISTERED: dict[str, Style] = {}  # rows a project added (planc.spec.extensions checks them first)
_fill_views(STYLES)


def add_style(row: Style) -> None:
    """Make a registered row a style everywhere (lint, schema, compiler, runtime registry). Callers check it first:
    `planc.spec.extensions.register_tp_style` is the one caller."""
    _REGISTERED[row.name] = row
    _fill_views(STYLES + tuple(_REGISTERED.values()))


def remove_style(name: str) -> None:
    """Drop a registered row (planc's own rows stay)."""
    _REGISTERED.pop(name, None)
    _fill_views(STYLES + tuple(_REGISTERED.values()))


# Removed styles -> what to write instead (used by lint hints and `planc migrate`).
REMOVED_STYLES: dict[str, str] = {
    "megamoe_router": "drop this router rule: Mega MoE takes global expert ids, no router hook is needed",
    "ep_router": "drop this router rule: the EP implementation masks and remaps expert ids itself",
    "megamoe_experts": "write `ep_dispatch_experts` on the experts module and set "
    "`experts.implementation: deepgemm_megamoe`",
}


def style(name: str) -> Optional[Style]:
    """The row of `name`, or None for a removed or unknown style."""
    return STYLE.get(name)


def splits_by_expert(name: str) -> bool:
    """`name` is a style that shards a parameter by expert (`grouped_gemm`)."""
    row = STYLE.get(name)
    return row is not None and row.by_expert


def dispatches_experts(name: str) -> bool:
    """`name` is the module style that replaces an experts forward with the plan's EP strategy
    (`ep_dispatch_experts`)."""
    return EXPERTS_MODULE_STYLES.get(name) == "ep"
