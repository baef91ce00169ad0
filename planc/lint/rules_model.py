"""Model rules: what lint can tell about `model:` without transformers (it ships transformers' model types)."""

from __future__ import annotations

from typing import Iterator

from planc.lint.context import LintContext
from planc.lint.diagnostic import WARNING, Diagnostic
from planc.lint.registry import rule
from planc.lint.suggest import did_you_mean
from planc.spec.transformers_model_types import MODEL_TYPES, TRANSFORMERS_VERSION

UNKNOWN_MODEL_TYPE = "PLC110"

_TAIL = "parallel: {tp_size: 2, ep_size: 2}\nep_plan:\n  model.layers.*.mlp.experts: ep_dispatch_experts\n"


@rule(
    UNKNOWN_MODEL_TYPE, "unknown-model-type", "`model.type` is not a model type transformers ships", severity=WARNING,
    bad="version: 1\nmodel: {type: mixtrl}\n" + _TAIL,
    good="version: 1\nmodel: {type: mixtral}\n" + _TAIL,
)
def check_model_type(ctx: LintContext) -> Iterator[Diagnostic]:
    """`model.type` is transformers' `config.model_type` of the model the plan is for (`mixtral`, `deepseek_v3`,
    `qwen3_moe`): `planc explain` and `planc init` build the model from it, and compiling checks it against the
    model's config (PLC607). planc ships the list of transformers' model types, so lint catches a typo without
    importing transformers; the hint names the closest type. For a model type of your own (registered with
    `AutoConfig.register`, or remote code), say so with `custom: true` under `model:`."""
    model = ctx.plan.model
    if model.custom or model.type in MODEL_TYPES:
        return
    guess = did_you_mean(model.type, MODEL_TYPES)
    own = "a model type of your own: write `custom: true` under `model:`"
    hint = (f"did you mean `{guess}`? (for {own})" if guess
            else f"write the model's `config.model_type` (`mixtral`, `qwen3_moe`, `deepseek_v3`, ...), or for {own}")
    yield ctx.diag(UNKNOWN_MODEL_TYPE, f"`{model.type}` is not a model type of transformers {TRANSFORMERS_VERSION}",
                   hint, ("model", "type"), at_value=True, fix=guess)
