"""Settings that exclude each other across keys: one table that the lint rules and the JSON Schema both read.

Each row says: when `when` holds (a key has a value, or a section is written at all), the setting at
`key` may take only `allowed`. The linter checks the merged plan against the rows (PLC400 and PLC401
through `planc.spec.ep.resolve_ep`, which the compiler calls too; PLC403 and PLC407 in `planc.lint.rules_ep`; PLC700
and PLC701 in `planc.lint.rules_training`),
and `planc schema` writes each row as an `if`/`then` fragment, so an editor with only the schema
(yaml-language-server) reports the same pairings on the value that breaks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from planc.spec.choices import DATA_PARALLEL_MODES, EP_STRATEGIES, EXPERTS_IMPLEMENTATIONS, MEGAMOE_BACKENDS


@dataclass(frozen=True)
class Pairing:
    code: str  # the lint rule that reports it
    when: tuple[str, ...]  # key path of the setting that constrains
    value: Optional[str]  # the value there that constrains; None: the key being written at all
    key: tuple[str, ...]  # key path of the constrained setting
    allowed: tuple[str, ...]  # what `key` may be then
    default: str  # what `key` is when not written (pydantic's default)
    why: str  # one line, for the schema's error message

    def applies(self, data: Any) -> bool:
        """Whether `when` holds in plain plan data."""
        found = _get(data, self.when)
        return found is not _ABSENT and (self.value is None or found == self.value)

    def violated(self, data: Any) -> bool:
        """Whether plain plan data (merged, extends resolved) breaks the pairing; defaults count as written."""
        if not self.applies(data):
            return False
        found = _get(data, self.key)
        return (self.default if found is _ABSENT or found is None else found) not in self.allowed


_ABSENT = object()


def _get(data: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        if not isinstance(data, dict) or part not in data:
            return _ABSENT
        data = data[part]
    return data


# Written from the rows of planc.spec.choices: the experts that run under one EP strategy only (Mega MoE), the
# strategy that needs its experts, the kernels without a backward, the settings block and the sharding modes.
_FUSED = next(i for i in EXPERTS_IMPLEMENTATIONS.values() if i.ep_strategy)
_FUSED_EP = EP_STRATEGIES[_FUSED.ep_strategy or ""]
_MEGAMOE = tuple(i.name for i in EXPERTS_IMPLEMENTATIONS.values() if i.megamoe)
_SHARDING = tuple(m.name for m in DATA_PARALLEL_MODES.values() if m.shards_parameters)

MEGAMOE_EXPERTS_EP = Pairing(
    "PLC400", ("experts", "implementation"), _FUSED.name, ("experts", "ep_implementation"),
    tuple(r.name for r in EP_STRATEGIES.values() if r.per_call) + (_FUSED_EP.name,), "auto",
    f"Mega MoE experts do their own dispatch and combine: they run only under the {_FUSED_EP.title} strategy",
)
MEGAMOE_EP_EXPERTS = Pairing(
    "PLC401", ("experts", "ep_implementation"), _FUSED_EP.name, ("experts", "implementation"),
    (_FUSED_EP.experts or "",), "grouped_mm",
    f"the {_FUSED_EP.title} strategy calls the Mega MoE kernel: it needs Mega MoE experts",
)
TRAINING_EXPERTS = Pairing(
    "PLC700", ("training",), None, ("experts", "implementation"),
    tuple(i.name for i in EXPERTS_IMPLEMENTATIONS.values() if not i.inference_only), "grouped_mm",
    "the Mega MoE kernel has no backward: a plan with `training:` cannot use it",
)

MEGAMOE_SETTINGS = Pairing(
    "PLC403", ("experts", "megamoe"), None, ("experts", "implementation"), _MEGAMOE, "grouped_mm",
    "the `megamoe:` settings apply only to Mega MoE experts",
)
MEGAMOE_BF16_BACKEND = Pairing(
    "PLC407", ("experts", "megamoe", "math"), "bf16", ("experts", "megamoe", "backend"),
    tuple(b.name for b in MEGAMOE_BACKENDS.values() if b.bf16_math), "auto",
    "`math: bf16` asks for BF16 MMAs: deep_gemm's kernel multiplies in FP8",
)
MIXED_PRECISION_FSDP = Pairing(
    "PLC701", ("training", "mixed_precision"), None, ("training", "data_parallel"), _SHARDING, "replicate",
    "`mixed_precision` is FSDP2's policy: it applies only with `data_parallel: fsdp`",
)

PAIRINGS: tuple[Pairing, ...] = (
    MEGAMOE_EXPERTS_EP, MEGAMOE_EP_EXPERTS, MEGAMOE_SETTINGS, MEGAMOE_BF16_BACKEND, TRAINING_EXPERTS,
    MIXED_PRECISION_FSDP,
)
