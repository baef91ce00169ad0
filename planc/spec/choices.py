"""The plan's other choices, one row each, like the style table: experts kernels, EP strategies, Mega MoE backends,
data-parallel modes and activation checkpointing modes.

Every layer that needs to know what a choice means asks its row: the plan model validates the names against
these tables and the JSON Schema lists them with their docs (`planc.spec.model`), the cross-key pairings are
written from the rows (`planc.spec.pairings`), `resolve_ep` builds the strategy from them (`planc.spec.ep`),
the compiler and the runtime read their properties (`CompiledPlan.experts_implementation`,
`CompiledPlan.data_parallel_mode`), and the runtime registries are keyed by their names with an import-time
drift check (`planc.runtime.ep.EP_RUNTIMES`, `planc.runtime.megamoe.runners.RUNNERS`,
`planc.runtime.activation_checkpointing.INSTALLERS`). Adding an EP strategy is
one row here plus one runtime object (docs/architecture.md shows it). No torch here.

The tables are dicts keyed by name, in the order the schema and the lint hints list them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, TypeVar


@dataclass(frozen=True)
class ExpertsImplementation:
    """One experts kernel (`experts.implementation`).

    `min_capability`: the CUDA compute capability its kernels need (None: runs anywhere). `package`: the Python
    package it imports. `ep_strategy`: the one EP strategy it runs under (a fused kernel that does its own
    dispatch and combine); `ep_implementation: auto` resolves to it. `inference_only`: no backward, so a plan
    with `training:` cannot use it. `megamoe`: the Mega MoE kernel: it reads `experts.megamoe` and planc installs
    its forward itself (transformers' experts dispatch is not switched to it). `class_forward`: the model class's
    own experts forward, so it runs also where the class refuses to switch its experts implementation.
    """

    name: str
    doc: str
    min_capability: Optional[tuple[int, int]] = None
    package: Optional[str] = None
    ep_strategy: Optional[str] = None
    inference_only: bool = False
    megamoe: bool = False
    class_forward: bool = False


@dataclass(frozen=True)
class EPStrategyRow:
    """One EP strategy (`experts.ep_implementation`): what the experts do across the EP group.

    `title`: the name of its strategy object (`explain`, the fingerprint, docs/ep.md). `needs_shared_batch`:
    every rank of the EP group must hold the same batch (ep_size == tp_size). `inference_only`: the kernel has no
    backward. `experts`: the experts implementation it needs (None: any). `per_call`: picks between strategies on
    each call (`auto`), so the compiler records whether the EP group shares the batch instead of one strategy.
    """

    name: str
    title: str
    doc: str
    needs_shared_batch: bool = False
    inference_only: bool = False
    experts: Optional[str] = None
    per_call: bool = False


@dataclass(frozen=True)
class MegaMoeBackend:
    """One Mega MoE backend (`experts.megamoe.backend`). `min_capability`: the CUDA compute capability it needs
    (None: any device). `per_device`: chooses among the others, in table order, where the plan is applied (`auto`).
    `kernel_blocks`: runs DeepGEMM's kernel, which takes hidden and intermediate sizes on its block grid only
    (planc.spec.megamoe): the compiler refuses other sizes, and warns when a `per_device` backend has to pass it
    over for them. `slow_fallback`: runs anywhere but many times slower; `per_device` warns when it picks it.
    `bf16_math`: can multiply as `experts.megamoe.math: bf16` asks (BF16 MMAs at every batch)."""

    name: str
    doc: str
    min_capability: Optional[tuple[int, int]] = None
    per_device: bool = False
    kernel_blocks: bool = False
    slow_fallback: bool = False
    bf16_math: bool = True


@dataclass(frozen=True)
class MegaMoeMath:
    """One way the Mega MoE experts multiply (`experts.megamoe.math`). `fp8_layout`: the Triton backend may take its
    FP8 path (on Hopper, at its table's batches) and hold that path's second layout of the FP4 experts once a batch
    does: the Triton runner keeps the FP8 rows of its table, and `planc explain` prices the layout."""

    name: str
    doc: str
    fp8_layout: bool = False


@dataclass(frozen=True)
class DataParallelMode:
    """One way the dp replicas train (`training.data_parallel`).

    `shards_parameters`: parameters, gradients and optimizer state are sharded over the replicas (FSDP2's
    `fully_shard`; `mixed_precision` is its policy), else every replica holds them whole. The meshes are not the
    mode's: every mode reduces dense weights over `dp` and EP-sharded experts over `efsdp`, the ranks that hold
    them (planc.runtime.mesh builds both from the plan's sizes).
    """

    name: str
    doc: str
    shards_parameters: bool = False


@dataclass(frozen=True)
class ActivationCheckpointingMode:
    """One way backward gets the activations it needs (`training.activation_checkpointing`).

    `installs`: what `planc.apply` installs for it (planc.runtime.activation_checkpointing). `memory`: what it
    changes in the training peak (`planc explain --train`, planc.compiler.peak_memory). `recomputes_layers`: each
    decoder layer keeps only its input for backward and recomputes its forward there.
    """

    name: str
    doc: str
    installs: str
    memory: str
    recomputes_layers: bool = False


Row = TypeVar("Row", ExpertsImplementation, EPStrategyRow, MegaMoeBackend, MegaMoeMath, DataParallelMode,
              ActivationCheckpointingMode)


def _table(*rows: Row) -> dict[str, Row]:
    return {r.name: r for r in rows}


EXPERTS_IMPLEMENTATIONS: dict[str, ExpertsImplementation] = _table(
    ExpertsImplementation("eager", "the model class's own experts forward, a loop over the experts",
                          class_forward=True),
    ExpertsImplementation("batched_mm", "one batched GEMM over the experts (transformers' kernel)"),
    ExpertsImplementation("grouped_mm", "torch grouped GEMM over the experts (transformers' default kernel)"),
    ExpertsImplementation("deepgemm", "DeepGEMM's grouped GEMM (transformers' kernel; CUDA sm_90+)",
                          min_capability=(9, 0)),
    ExpertsImplementation("sonicmoe", "SonicMoE's kernels (transformers' kernel; CUDA sm_90+, the `sonicmoe` package)",
                          min_capability=(9, 0), package="sonicmoe"),
    ExpertsImplementation("deepgemm_megamoe", "DeepGEMM Mega MoE: dispatch, FP8xFP4 GEMMs and combine in one kernel "
                          "(inference only; settings in `experts.megamoe`)",
                          ep_strategy="deepgemm_megamoe", inference_only=True, megamoe=True),
)

EP_STRATEGIES: dict[str, EPStrategyRow] = _table(
    EPStrategyRow("auto", "AutoEP", "all_reduce when the EP group shares the batch and no gradient flows, else "
                  "all_to_all (per call); the fused strategy of experts that have one", per_call=True),
    EPStrategyRow("all_to_all", "AllToAllEP", "only routed tokens move: counts exchange, token all-to-all, local "
                  "experts, reverse all-to-all (any layout)"),
    EPStrategyRow("all_reduce", "AllReduceEP", "every rank runs its experts over the whole batch (off-rank slots "
                  "masked), outputs all-reduced (ep_size == tp_size)", needs_shared_batch=True),
    EPStrategyRow("deepgemm_megamoe", "MegaMoeEP", "DeepGEMM Mega MoE: equal batch slice per rank, fused "
                  "dispatch+GEMMs+combine, outputs all-gathered (Mega MoE experts only)",
                  needs_shared_batch=True, inference_only=True, experts="deepgemm_megamoe"),
)

MEGAMOE_BACKENDS: dict[str, MegaMoeBackend] = _table(
    MegaMoeBackend("auto", "deep_gemm on SM100, triton on SM90+, else the reference with a warning", per_device=True),
    MegaMoeBackend("deep_gemm", "DeepGEMM's SM100 kernel", min_capability=(10, 0), kernel_blocks=True,
                   bf16_math=False),
    MegaMoeBackend("triton", "the Triton backend: FP4 kept packed (a CUDA GPU of sm_90 or newer)",
                   min_capability=(9, 0)),
    MegaMoeBackend("reference", "the PyTorch reference of the kernel's computation (any device; slow)",
                   slow_fallback=True),
)

MEGAMOE_MATH: dict[str, MegaMoeMath] = _table(
    MegaMoeMath("auto", "the backend's choice: triton multiplies prefill-sized batches in FP8 on Hopper (its table's "
                "rows), holding a second layout of the FP4 experts once a batch does; deep_gemm always in FP8",
                fp8_layout=True),
    MegaMoeMath("bf16", "BF16 MMAs over the FP4 experts expanded on chip, at every batch: one layout of the experts "
                "held (triton and reference; not deep_gemm)"),
)

DATA_PARALLEL_MODES: dict[str, DataParallelMode] = _table(
    DataParallelMode("replicate", "every dp replica holds the model, gradients averaged over the global batch "
                     "during backward"),
    DataParallelMode("fsdp", "FSDP2 `fully_shard` per decoder layer and on the root: parameters, gradients and "
                     "optimizer state sharded over the replicas", shards_parameters=True),
)

ACTIVATION_CHECKPOINTING_MODES: dict[str, ActivationCheckpointingMode] = _table(
    ActivationCheckpointingMode(
        "none", "every activation is kept for backward",
        installs="nothing",
        memory="none: every layer's activations are held until its backward"),
    ActivationCheckpointingMode(
        "full", "every decoder layer keeps only its input for backward and recomputes the rest",
        installs="transformers' gradient_checkpointing_enable (non-reentrant torch.utils.checkpoint around every "
        "decoder layer), before the data-parallel wrap",
        memory="the activations kept for backward shrink to one input per decoder layer; one layer's activations "
        "are recomputed at a time during backward",
        recomputes_layers=True),
)


__all__ = [
    "ACTIVATION_CHECKPOINTING_MODES", "ActivationCheckpointingMode", "DATA_PARALLEL_MODES", "EP_STRATEGIES", "EXPERTS_IMPLEMENTATIONS", "MEGAMOE_BACKENDS", "DataParallelMode",
    "EPStrategyRow", "ExpertsImplementation", "MegaMoeBackend",
]
