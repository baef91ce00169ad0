"""Whether the installed transformers keeps a family's router weight in fp32 inside a bf16 model.

DeepSeek-V3 and GLM-4.5 declare it in `_keep_in_fp32_modules_strict`: "gate.weight" from transformers 5.24 on,
only `e_score_correction_bias` in 5.23 (their routers are then bf16). planc follows what transformers builds, so the
tests that state those routers' bytes, dtypes or FSDP units read transformers' own declaration here and hold on
every transformers planc supports (pyproject: transformers>=5.23).
"""

from __future__ import annotations


def routers_kept_fp32(model_type: str) -> bool:
    """True when `model_type`'s causal-LM class keeps `gate.weight` (the router) in fp32."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    return "gate.weight" in (getattr(cls, "_keep_in_fp32_modules_strict", None) or [])
