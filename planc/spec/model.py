"""Pydantic models of plan format v1: the single source of truth for the schema.

`planc schema` prints `Plan.model_json_schema()`; `schemas/plan.schema.json` is that output. Style
names are plain strings at this level (the schema lists the valid ones for editors) so that the
linter can tell a removed style, with its migration, from a typo, with its did-you-mean.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, PlainValidator
from pydantic_core import PydanticCustomError

from planc.spec import choices
from planc.spec.patterns import PATTERN_SYNTAX
from planc.spec.styles import TABLE_STYLES

TrainDtype = Literal["float32", "bfloat16", "float16"]


class Choice:
    """A field whose values are the names of one table of `planc.spec.choices`, read when a plan is validated
    and when the schema is written (so a row added to the table is a valid value everywhere at once). A bad
    value is pydantic's `literal_error`, worded as pydantic words it, so lint reports it like any enum."""

    def __init__(self, table: dict[str, Any]) -> None:
        self.table = table
        self.validator = PlainValidator(self.validate, json_schema_input_type=str)
        self.field = Field(json_schema_extra=self.schema)

    @property
    def names(self) -> list[str]:
        return list(self.table)

    def validate(self, value: Any) -> str:
        if isinstance(value, str) and value in self.table:
            return value
        *most, last = (repr(n) for n in self.table)
        expected = f"{', '.join(most)} or {last}" if most else last
        raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})

    def schema(self, schema: dict[str, Any]) -> None:
        schema["enum"] = self.names
        schema["enumDescriptions"] = [row.doc for row in self.table.values()]


_IMPL, _EP, _BACKEND, _MATH, _DP, _AC = (Choice(t) for t in (
    choices.EXPERTS_IMPLEMENTATIONS, choices.EP_STRATEGIES, choices.MEGAMOE_BACKENDS, choices.MEGAMOE_MATH,
    choices.DATA_PARALLEL_MODES, choices.ACTIVATION_CHECKPOINTING_MODES))
ExpertsImplementationName = Annotated[str, _IMPL.validator, _IMPL.field, _IMPL]
EPImplementationName = Annotated[str, _EP.validator, _EP.field, _EP]
MegaMoeBackendName = Annotated[str, _BACKEND.validator, _BACKEND.field, _BACKEND]
MegaMoeMathName = Annotated[str, _MATH.validator, _MATH.field, _MATH]
DataParallelName = Annotated[str, _DP.validator, _DP.field, _DP]
ActivationCheckpointingName = Annotated[str, _AC.validator, _AC.field, _AC]


def _styles(table: str, what: str) -> Any:
    """The field of a style in one rule table: the schema lists only the styles legal there, each with its own doc
    (editors show it on completion and hover). The type stays `str` for pydantic, so that lint tells a removed
    style (PLC320) or a style of the other table (PLC311/312) from a typo (PLC310)."""
    styles = TABLE_STYLES[table]  # filled in place: a registered style (planc.spec.extensions) is listed too

    def schema(out: dict[str, Any]) -> None:
        out["enum"], out["enumDescriptions"] = list(styles), list(styles.values())

    return Field(
        # editors show this on hover over the value and over its key: both halves of `pattern: style`
        description=f"A {what} style (transformers' vocabulary): what the modules the pattern (the key) matches "
        f"become. The pattern: {PATTERN_SYNTAX}",
        json_schema_extra=schema,
    )


TpStyle = Annotated[str, _styles("tp_plan", "tensor-parallel")]
EpStyle = Annotated[str, _styles("ep_plan", "expert-parallel")]
PatternText = Annotated[
    str,
    Field(
        min_length=1,
        description=PATTERN_SYNTAX,
    ),
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelRef(_Strict):
    """Which transformers model family the plan is written for."""

    type: str = Field(min_length=1, description="transformers `config.model_type`, e.g. `mixtral`.")
    custom: bool = Field(
        default=False,
        description="`true`: `type` is a model type transformers does not ship (registered with "
        "`AutoConfig.register`, or remote code), so lint does not check it against transformers' model types.",
    )


class Parallel(_Strict):
    """Parallel sizes. World size is `tp_size * dp_size`; the EP group is `ep_size` consecutive ranks."""

    tp_size: int = Field(ge=1, description="Tensor-parallel group size.")
    ep_size: int = Field(default=1, ge=1, description="Expert-parallel group size.")
    dp_size: int = Field(default=1, ge=1, description="Data-parallel replicas.")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.dp_size


class MegaMoe(_Strict):
    """Settings of the DeepGEMM Mega MoE experts (only with `implementation: deepgemm_megamoe`)."""

    backend: MegaMoeBackendName = Field(
        default="auto",
        description="`deep_gemm` (SM100 kernel), `triton` (FP4 kept packed; any CUDA GPU), `reference` (PyTorch) or "
        "`auto` (deep_gemm on SM100, triton on SM90+, else the reference with a warning).",
    )
    max_tokens_per_rank: Optional[int] = Field(
        default=None, ge=1, description="Pre-sizes the shared symmetric buffer (tokens per rank)."
    )
    activation_clamp: Optional[float] = Field(
        default=None, ge=0, description="SwiGLU clamp; absent: the model config's `swiglu_limit`, else none."
    )
    quantize: Literal["none", "fp4"] = Field(
        default="none", description="`fp4`: quantize bf16 experts to FP4 when the plan is applied."
    )
    math: MegaMoeMathName = Field(
        default="auto",
        description="`auto`: the backend's choice (`triton` on Hopper multiplies prefill-sized batches in FP8, holding "
        "a second layout of the FP4 experts once a batch does); `bf16`: BF16 MMAs at every batch, one layout held "
        "(`triton` and `reference`; `deep_gemm`'s kernel multiplies in FP8).",
    )

    @property
    def math_row(self) -> choices.MegaMoeMath:
        """The row of `math` in `planc.spec.choices.MEGAMOE_MATH`."""
        return choices.MEGAMOE_MATH[self.math]

    @property
    def backend_row(self) -> choices.MegaMoeBackend:
        """The row of `backend` in `planc.spec.choices.MEGAMOE_BACKENDS`."""
        return choices.MEGAMOE_BACKENDS[self.backend]


class Experts(_Strict):
    """How the experts compute (`implementation`) and how they are spread over ranks (`ep_implementation`)."""

    implementation: ExpertsImplementationName = Field(default="grouped_mm", description="Experts kernel.")
    ep_implementation: EPImplementationName = Field(default="auto", description="Expert-parallel strategy.")
    megamoe: Optional[MegaMoe] = None

    @property
    def implementation_row(self) -> choices.ExpertsImplementation:
        """The row of `implementation` in `planc.spec.choices.EXPERTS_IMPLEMENTATIONS`."""
        return choices.EXPERTS_IMPLEMENTATIONS[self.implementation]

    @property
    def ep_implementation_row(self) -> choices.EPStrategyRow:
        """The row of `ep_implementation` in `planc.spec.choices.EP_STRATEGIES`."""
        return choices.EP_STRATEGIES[self.ep_implementation]


class MixedPrecision(_Strict):
    """FSDP2 mixed precision (`MixedPrecisionPolicy`): compute in `param_dtype`, reduce gradients in
    `reduce_dtype`; the sharded parameters and the optimizer state stay in the model's dtype."""

    param_dtype: TrainDtype = Field(description="Dtype the parameters are all-gathered to and the forward runs in.")
    reduce_dtype: TrainDtype = Field(default="float32", description="Dtype gradients are reduce-scattered in.")


class Training(_Strict):
    """How the plan's `dp_size` replicas train: gradients synchronised (`replicate`) or parameters,
    gradients and optimizer state sharded over them (`fsdp`, torch FSDP2)."""

    data_parallel: DataParallelName = Field(
        default="replicate",
        description="`replicate`: every dp replica holds the model, gradients averaged over the global batch "
        "during backward; `fsdp`: FSDP2 `fully_shard` per decoder layer and on the root.",
    )
    mixed_precision: Optional[MixedPrecision] = Field(
        default=None, description="FSDP2 mixed precision; only with `data_parallel: fsdp`."
    )
    activation_checkpointing: ActivationCheckpointingName = Field(
        default="none",
        description="; ".join(f"`{m.name}`: {m.doc}" for m in choices.ACTIVATION_CHECKPOINTING_MODES.values())
        + " (installed by apply, priced by `planc explain --train`).",
    )

    @property
    def data_parallel_row(self) -> choices.DataParallelMode:
        """The row of `data_parallel` in `planc.spec.choices.DATA_PARALLEL_MODES`."""
        return choices.DATA_PARALLEL_MODES[self.data_parallel]

    @property
    def activation_checkpointing_row(self) -> choices.ActivationCheckpointingMode:
        """The row of `activation_checkpointing` in `planc.spec.choices.ACTIVATION_CHECKPOINTING_MODES`."""
        return choices.ACTIVATION_CHECKPOINTING_MODES[self.activation_checkpointing]


class Plan(_Strict):
    """A planc plan, format version 1."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        title="planc plan",
        json_schema_extra={"$id": "https://planc.dev/schemas/plan.schema.json"},
    )

    version: Literal[1] = Field(description="Plan format version; must be 1.")
    name: Optional[str] = None
    description: Optional[str] = None
    extends: Optional[str] = Field(default=None, description="Parent plan: a path relative to this file, or `planc:NAME` for "
                                   "the plan planc ships as NAME (`planc:deepseek_v3`).")
    model: ModelRef
    parallel: Parallel
    experts: Experts = Field(default_factory=Experts)
    tp_plan: dict[PatternText, TpStyle] = Field(
        default_factory=dict,
        description="Tensor-parallel rules, `pattern: style`. " + PATTERN_SYNTAX,
    )
    ep_plan: dict[PatternText, EpStyle] = Field(
        default_factory=dict,
        description="Expert-parallel rules, `pattern: style`: `grouped_gemm` on the experts parameters, "
        "`ep_dispatch_experts` on the experts module. " + PATTERN_SYNTAX,
    )
    training: Optional[Training] = Field(
        default=None, description="How the model trains over the dp replicas; absent: `data_parallel: replicate`."
    )
