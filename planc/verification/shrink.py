"""The shrink rule: a model small enough for a CPU world at the plan's own sizes that shards exactly as the real one.

Starting point: planc's tiny-config derivation (`planc.models.tiny`: one layer of every kind the config has —
dense-first and MoE layers, sliding/full/linear attention, shared experts, MTP —, small widths, equal sizes kept
equal). Then every count the plan divides keeps whether it divides:

- heads (query, KV, linear-attention heads) and intermediate sizes by `tp_size`,
- experts by `ep_size`,

taking the smallest value >= the tiny one (at most the real value) that the size divides exactly when it divides
the real one: a size that splits evenly still does (and gives every rank at least one head or expert), one that
does not still does not (the plan drops the same rules). Intermediate sizes prefer multiples of 4 (fp32 rows of
16 bytes, which grouped_mm needs). Query heads stay a multiple of KV heads, linear value heads of key heads.

The result is checked, not trusted: the plan is compiled against the real model (on the meta device) and against
the shrunk one, and the shrink is refused unless both give the same rules, active or dropped, with the same
styles, and the same warnings. `--no-shrink` runs the real widths with the fewest layers instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, TypeGuard

from planc.errors import CompileError, ModelBuildError, VerifyError

_HEAD_SUFFIXES = ("_heads",)
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_INTERMEDIATE = ("intermediate_size", "ffn_hidden_size", "moe_hidden_size", "intermediate_dim", "ffn_dim")
_GROUPED = (("num_attention_heads", "num_key_value_heads"), ("linear_num_value_heads", "linear_num_key_heads"))
_LAYER_COUNTS = ("num_hidden_layers", "num_layers")


@dataclass(frozen=True)
class Shrunk:
    """The config every rank builds and the lines that say how it was derived."""

    config: Any
    lines: tuple[str, ...]


def _divisor(key: str, tp: int, ep: int) -> Optional[int]:
    if key in _EXPERT_KEYS:
        return ep
    if key.endswith(_HEAD_SUFFIXES) or any(m in key for m in _INTERMEDIATE):
        return tp
    return None


def shrunk_count(tiny: int, real: int, size: int, align: int = 1) -> int:
    """The smallest value >= `tiny`, at most `real`, that `size` divides exactly when it divides `real`; among
    those, a multiple of `align` when one is near (a width that grouped_mm reads needs 16-byte rows)."""
    if size <= 1:
        return min(tiny, real)
    divides = real % size == 0
    fits = [v for v in range(tiny, tiny + 4 * size * align + 1) if (v % size == 0) == divides]
    aligned = [v for v in fits if v % align == 0]
    return min((aligned or fits)[0], real)


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def size_overrides(tiny: dict, real: dict, tp: int, ep: int, *, every_count: bool = True) -> dict:
    """{key: value} for the tiny config so that every count keeps whether its divisor divides it; with
    `every_count` False, only the counts the divisor divides (a width the plan reaches only through a product, as
    shared experts' n_shared_experts x moe_intermediate_size, then keeps its tiny value)."""
    out: dict = {}
    for key, t in tiny.items():
        r = real.get(key)
        size = _divisor(key, tp, ep)
        if size is None or not (_is_int(t) and _is_int(r)) or t <= 0 or r <= 0:
            continue
        if not every_count and r % size:
            continue
        value = shrunk_count(t, r, size, align=4 if size == tp and not key.endswith(_HEAD_SUFFIXES) else 1)
        if value != t:
            out[key] = value
    for many, few in _GROUPED:
        m, f = out.get(many, tiny.get(many)), out.get(few, tiny.get(few))
        rm, rf = real.get(many), real.get(few)
        if _is_int(m) and _is_int(f) and _is_int(rm) and _is_int(rf) and min(m, f, rm, rf) > 0 and rm % rf == 0 \
                and m % f:
            out[many] = math.lcm(m, f)
    return out


def _text(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def shrink(real: Any, model_type: str, plan: Any, *, user_overrides: Optional[dict] = None) -> list[Shrunk]:
    """The shrunk configs of `real` (a transformers config) for `plan` (a LoadedPlan at the sizes that will run), in
    the order to try them (`check_faithful` picks the first that shards as the real model): the counts the plan's
    sizes divide made divisible, then every count keeping whether it divides."""
    from planc.models.build import tiny_config
    from planc.models.families import family
    from planc.models.tiny import shrink_config

    p = plan.plan.parallel
    real_text = _text(real).to_dict()
    try:
        try:
            fam = family(model_type)
        except KeyError:
            fam = None
        if fam is not None and (fam.multimodal or not user_overrides and real_text == _text(type(real)()).to_dict()):
            base = tiny_config(fam)
            build = lambda **kw: tiny_config(fam, **kw)  # noqa: E731 - the family's derivation with more overrides
        else:
            cls = type(_text(real))
            base = shrink_config(cls, real_text)
            build = lambda **kw: shrink_config(cls, real_text, **kw)  # noqa: E731
        tiny_text = _text(base).to_dict()
        configs, seen = [], []
        for every in (False, True):
            sizes = size_overrides(tiny_text, real_text, p.tp_size, p.ep_size, every_count=every)
            if sizes not in seen:
                seen.append(sizes)
                configs.append(build(**sizes) if sizes else base)
    except ModelBuildError as e:
        raise VerifyError(f"no shrink of this `{model_type}` config builds: {e}; run the real widths with --no-shrink"
                          ) from None
    except Exception as e:  # noqa: BLE001 - transformers' config validation raises anything
        raise VerifyError(f"no shrink of this `{model_type}` config builds: {type(e).__name__}: {e}; run the real "
                          "widths with --no-shrink") from None
    out = []
    for config in configs:
        shrunk_text = _text(config).to_dict()
        changed = [k for k in sorted(shrunk_text) if _is_int(shrunk_text[k]) and _is_int(real_text.get(k))
                   and shrunk_text[k] != real_text[k]]
        lines = ["one layer of each kind, small widths (planc.models.tiny); counts the plan divides keep whether "
                 f"tp_size={p.tp_size} (heads, intermediate sizes) and ep_size={p.ep_size} (experts) divide them"]
        lines.append(", ".join(f"{k} {real_text[k]}->{shrunk_text[k]}" for k in changed))
        out.append(Shrunk(config, tuple(lines)))
    return out


def no_shrink(real: Any) -> Shrunk:
    """The real widths with the fewest layers that hold one of every kind (`--no-shrink`)."""
    from planc.models.tiny import _kept_layers

    text = _text(real)
    d = text.to_dict()
    key = next((k for k in _LAYER_COUNTS if _is_int(d.get(k))), None)
    if key is None or d[key] <= 2:
        return Shrunk(real, ("--no-shrink: the real config, unchanged",))
    keep = _kept_layers(d, d[key])
    setattr(text, key, len(keep))
    for k, v in d.items():
        if isinstance(v, list) and len(v) == d[key]:
            setattr(text, k, [v[i] for i in keep])
    return Shrunk(real, (f"--no-shrink: the real widths, {len(keep)} of {d[key]} layers (one of each kind)",))


def coverage_signature(compiled: Any) -> set:
    """What a plan does to a model, independent of its widths: each rule, active or not, matched or not, with its
    style; and the warnings by code and rule."""
    sig: set[tuple[Any, ...]] = {(c.rule.table, c.rule.pattern, c.rule.style, c.active, c.modules + c.parameters > 0) for c in compiled.coverage}
    sig |= {("warning", w.code, str(w.key or w.position)) for w in compiled.warnings}
    return sig


def check_faithful(real_model: Any, tiny_model: Any, plan: Any) -> None:
    """VerifyError unless the plan compiles the same way against the real model (meta device) and the shrunk one."""
    from planc.compiler.resolve import compile_plan

    try:
        want = coverage_signature(compile_plan(real_model, plan))
    except CompileError:
        return  # the real model does not compile: the shrunk model's compile reports it (exit 2) with the diagnostics
    try:
        got = coverage_signature(compile_plan(tiny_model, plan))
    except CompileError as e:
        raise VerifyError("the shrunk model does not compile although the real one does, so no faithful shrink "
                          f"exists here; run the real widths with --no-shrink. The shrunk model's problems:\n{e}"
                          ) from None
    if want != got:
        only_real = sorted(map(str, want - got))
        only_tiny = sorted(map(str, got - want))
        raise VerifyError("the shrink would change how the plan shards the model (a divisibility the plan relies on "
                          f"would break): at the real widths {only_real}, shrunk {only_tiny}; run the real widths with "
                          "--no-shrink")
