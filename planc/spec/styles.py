"""The style vocabulary a plan may use, in transformers' current (>= 5.23) names.

Kept as data so the linter, the compiler and the runtime agree on one list, and so that removed
styles can be recognised and migrated instead of being reported as plain typos.
"""

from __future__ import annotations

TP_STYLES: dict[str, str] = {
    "colwise": "shard the output features (weight dim -2); output stays sharded",
    "colwise_gather_output": "colwise, output all-gathered (lm_head)",
    "rowwise": "shard the input features (weight dim -1); output all-reduced",
    "rowwise_split_input": "rowwise that slices a replicated input itself",
    "packed_colwise": "colwise for fused gate|up weights (each half sharded separately)",
    "packed_rowwise": "rowwise for weights packed on the last dim",
    "embedding_rowwise": "vocab-parallel embedding, partial lookups summed",
    "embedding_colwise": "hidden-dim sharded embedding, gathered",
    "sequence_parallel": "replicated params, activations sharded on the sequence dim",
    "replicated_with_grad_allreduce": "replicated params whose gradients are all-reduced",
    "mla_kv_a_proj": "MLA kv_a_proj_with_mqa: rope slice all-reduced in backward",
    "all_reduce": "all-reduce a module's partial output",
    "moe_tp_experts": "tensor-parallel experts (each rank a slice of every expert)",
    "moe_identity_expert": "identity expert input divided by the TP size",
    "local_params": "run the module on its local shards",
    "replicate": "every rank keeps the full parameter",
}

EP_STYLES: dict[str, str] = {
    "grouped_gemm": "shard the expert dimension of an experts parameter over the EP group",
    "ep_dispatch_experts": "replace the experts forward with the plan's EP implementation",
}

# Every current style name. Which table takes which is checked by the lint style rules (PLC311,
# PLC312): EP styles and `replicate` in ep_plan, TP styles in tp_plan.
ALL_STYLES: dict[str, str] = {**TP_STYLES, **EP_STYLES}

# Removed styles -> what to write instead (used by lint hints and `planc migrate`).
REMOVED_STYLES: dict[str, str] = {
    "megamoe_router": "drop this router rule: Mega MoE takes global expert ids, no router hook is needed",
    "ep_router": "drop this router rule: the EP implementation masks and remaps expert ids itself",
    "megamoe_experts": "write `ep_dispatch_experts` on the experts module and set "
    "`experts.implementation: deepgemm_megamoe`",
}

# Styles whose target is a parameter rather than a module.
PARAMETER_STYLES = frozenset({"grouped_gemm"})

# The styles planc's runtime installs today. The compiler refuses the others instead of skipping them.
RUNTIME_STYLES = frozenset(
    {
        "colwise",
        "colwise_gather_output",
        "rowwise",
        "rowwise_split_input",
        "packed_colwise",
        "embedding_rowwise",
        "replicate",
        "replicated_with_grad_allreduce",
        "moe_tp_experts",
        "packed_rowwise",
        "local_params",
        "all_reduce",
        "grouped_gemm",
        "ep_dispatch_experts",
    }
)
