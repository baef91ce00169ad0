"""Build transformers MoE models from configs: tiny random ones for tests and the demo, full-size on meta.

Tests, `planc demo` and `planc explain` need real transformers models without the hub. The tiny
configs keep every dimension the shipped plans shard divisible by 4 (heads, KV heads, experts), so
the same model runs on 1, 2 and 4 ranks. `meta_model` is the one builder on the meta device (no
memory) of the model the compiler walks: the family's default (full-size) config for `planc explain`
and `planc init` (`build_meta_model`), a checkpoint's config for `planc.load`, a tiny config for the
family sweep. Every transformers failure becomes one ModelBuildError line naming the model type.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Optional

from planc.errors import ModelBuildError, one_line

# Small enough for CPU tests (forward < 50 ms), big enough that every sharded dim splits over 4 ranks.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": dict(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=128,
    ),
    "qwen3_moe": dict(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=128,
    ),
    "gpt_oss": dict(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128,
    ),
    "deepseek_v3": dict(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=128,
    ),
    "deepseek_v4": dict(
        vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, q_lora_rank=32, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=4,
        sliding_window=8, qk_rope_head_dim=8, hc_mult=2, hc_sinkhorn_iters=2,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe"], max_position_embeddings=128,
    ),
}

MODEL_TYPES = tuple(TINY_CONFIGS)


def _cause(exc: BaseException) -> str:
    """`ExcType: message` on one line (what transformers said, quoted in a ModelBuildError)."""
    return f"{type(exc).__name__}: {one_line(exc, 300) or '(no message)'}"


def known_model_types() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(CONFIG_MAPPING_NAMES)


def config_class(model_type: str):
    """transformers' config class for `model_type`; an unknown type names the closest few known ones."""
    from transformers import AutoConfig

    from planc.lint.suggest import close_matches

    try:
        return type(AutoConfig.for_model(model_type))
    except Exception:  # noqa: BLE001 - ValueError with every model type listed (~7 KB): replaced below
        known = known_model_types()
        close = close_matches(str(model_type), known)
        moe = [t for t in MODEL_TYPES if t not in close]
        hint = (f"did you mean {', '.join(f'`{c}`' for c in close)}?" if close
                else "use a transformers `config.model_type`, e.g. " + ", ".join(f"`{t}`" for t in moe))
        raise ModelBuildError(f"transformers knows no model type `{model_type}`; {hint}") from None


def build_config(model_type: str, overrides: Optional[dict] = None):
    """The config of `model_type` with `overrides` (config keyword arguments); ModelBuildError on any failure."""
    cls = config_class(model_type)
    try:
        return cls(**(overrides or {}))
    except Exception as e:  # e.g. transformers' StrictDataclassFieldValidationError for a bad value
        raise ModelBuildError(f"cannot build a `{model_type}` config ({cls.__name__}): {_cause(e)}") from e


def causal_lm_class(config):
    """The `*ForCausalLM` class transformers builds for a config (what a plan's `model.` paths refer to)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        raise ModelBuildError(
            f"`{config.model_type}` has no *ForCausalLM class in transformers: planc plans shard causal LMs"
        ) from None


def tiny_config(model_type, **overrides):
    """The tiny config of `model_type` (a family's model type or its top model's, or a Family) that the
    tests, `planc demo` and the family sweep build: derived from the family's own config class
    (`planc.models.tiny`), with the hand-tuned values of TINY_CONFIGS and then `overrides` on top.
    fp32, eager attention. ModelBuildError when transformers rejects it."""
    from planc.models.families import Family, family
    from planc.models.tiny import tiny_family_config

    if isinstance(model_type, Family):
        fam = model_type
    else:
        config_class(model_type)  # an unknown type: ModelBuildError naming the closest known ones
        try:
            fam = family(model_type)
        except KeyError:
            raise ModelBuildError(f"`{model_type}` is not a MoE family of transformers: no tiny config for it") from None
    kwargs = {**TINY_CONFIGS.get(fam.text_type, {}), **overrides}
    try:
        return tiny_family_config(fam, **kwargs)
    except Exception as e:  # transformers' config validation raises anything
        raise ModelBuildError(
            f"cannot build a tiny `{fam.model_type}` config ({fam.config_class().__name__}): {_cause(e)}"
        ) from e


def build_tiny_model(model_type, *, seed: int = 0, experts_implementation: Optional[str] = None, **overrides):
    """A tiny random model of `model_type` (a type name or a Family): the family's top model (`*ForCausalLM`, or
    the multimodal model holding the family's config), fp32, eval mode, identical for the same seed on every rank."""

    from planc.models.families import Family

    config = tiny_config(model_type, **overrides)
    cls = model_type.model_class(config) if isinstance(model_type, Family) else None
    return build_random_model(config, seed=seed, model_class=cls, experts_implementation=experts_implementation)


def build_random_model(config, *, seed: int = 0, model_class: Any = None, experts_implementation: Optional[str] = None,
                       trust_remote_code: bool = False):
    """A random model of `config` (`model_class`, default `model_class_for(config)`; a config of remote code with
    `trust_remote_code`: the class its `auto_map` names), fp32, eval mode, identical for the same seed on every rank:
    no parameter left at a constant (zeros and ones hide sharding mistakes). ModelBuildError on any failure."""
    import torch

    torch.manual_seed(seed)
    kwargs: dict[str, Any] = {"experts_implementation": experts_implementation} if experts_implementation else {}
    with _uninitialized_memory_is_nan():
        if model_class is None and trust_remote_code and getattr(config, "auto_map", None):
            model = _remote_code_model(config, **kwargs)
        else:
            model = _instantiate(model_class or model_class_for(config), config, dtype=torch.float32, **kwargs)
    _randomize_uninitialized(model, seed)
    _randomize_zero_inits(model, seed)
    return model.eval()


def _remote_code_model(config, **kwargs):
    """The *ForCausalLM of a config whose modeling code ships with the checkpoint (`auto_map`)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config, trust_remote_code=True, dtype=torch.float32, **kwargs)
    except Exception as e:  # remote modeling code raises anything
        raise ModelBuildError(
            f"the checkpoint's own modeling code cannot build a `{config.model_type}` model: {_cause(e)}") from e


@contextlib.contextmanager
def _uninitialized_memory_is_nan():
    """While building: `torch.empty` fills float memory with NaN (torch's deterministic mode), so that a parameter
    transformers' `_init_weights` never reaches (the Qwen3 Omni talker's experts: the top model's init only knows
    the thinker's MoE block) is all NaN, not whatever the allocator held, which differs between ranks."""
    import torch
    import torch.utils.deterministic

    det: Any = torch.utils.deterministic  # its flag is a property of the module's class, which stubs do not show
    was_det, was_warn, was_fill = (torch.are_deterministic_algorithms_enabled(),
                                   torch.is_deterministic_algorithms_warn_only_enabled(), det.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        yield
    finally:
        det.fill_uninitialized_memory = was_fill
        torch.use_deterministic_algorithms(was_det, warn_only=was_warn)


def _randomize_uninitialized(model, seed: int) -> None:
    """Give the parameters transformers left uninitialized (all NaN, see `_uninitialized_memory_is_nan`) seeded
    normal values (std 0.02), the same on every rank."""
    import torch

    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.is_floating_point() and p.numel() and bool(torch.isnan(p).all()):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def _randomize_zero_inits(model, seed: int) -> None:
    """Give zero/one-initialised parameters (router biases, norms, sinks) random values too.

    A parameter left at zero or one hides sharding mistakes (a wrongly sliced zero bias is still zero).
    """
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in model.named_parameters():
            flat = p.detach().flatten()
            if flat.numel() and bool((flat == flat[0]).all()):
                p.add_(0.02 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.01 * torch.randn(b.shape, generator=gen, dtype=b.dtype))


def clone_model(model):
    """An independent deep copy (the unsharded reference in tests and the demo)."""
    return copy.deepcopy(model)


def meta_model(config: Any, *, model_class: Any = None, dtype: Any = None) -> Any:
    """The model of `config` on the meta device (no memory: `planc explain` resolves a plan against a 600B-parameter
    model): `model_class` (default `model_class_for(config)`: the family's top model, else the *ForCausalLM) in
    `dtype` (default: transformers' choice for the config). The one meta-model builder: `planc explain`, `planc init`,
    `planc.load` and the family sweep build through it. ModelBuildError on any failure."""
    import torch

    cls = model_class if model_class is not None else model_class_for(config)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    with torch.device("meta"):
        return _instantiate(cls, config, **kwargs)


def build_meta_model(model_type: str, config_overrides: Optional[dict] = None, *, dtype=None):
    """`meta_model` of `model_type`'s config: transformers' defaults with `config_overrides` (dotted keys reach
    sub-configs, `text_config.num_hidden_layers`); full-size unless the overrides say otherwise."""
    return meta_model(overridden_config(model_type, config_overrides), dtype=dtype)


def overridden_config(model_type: str, config_overrides: Optional[dict] = None):
    """`build_config` with dotted override keys (`text_config.num_hidden_layers`) reaching sub-configs."""
    return build_config(model_type, _nest(config_overrides or {}))


def _instantiate(cls, config, **kwargs):
    """`cls._from_config(config, **kwargs)`; any exception from transformers becomes one ModelBuildError line naming
    the model type, the class and what failed."""
    try:
        return cls._from_config(config, **kwargs)
    except Exception as e:  # transformers raises anything from a config it cannot build
        raise ModelBuildError(
            f"transformers cannot build a `{config.model_type}` model ({cls.__name__}) from this config: {_cause(e)}"
        ) from e


def check_override_keys(model_type: str, overrides: dict) -> None:
    """ModelBuildError when an override (`--set KEY=VALUE`; dotted keys reach sub-configs) names a key the config
    class does not have and its model's code does not read: transformers would store it as a new attribute and build
    the default model unchanged."""
    from planc.lint.suggest import close_matches

    for key in overrides:
        cls, path = config_class(model_type), list[str]()
        for part in key.split("."):
            known = _config_keys(cls)
            if known is None:  # not a dataclass config: nothing to compare against
                break
            if part not in known and not _read_by_model_code(cls, part):
                close = [".".join([*path, c]) for c in close_matches(part, sorted(known))]
                hint = (f"did you mean {', '.join(f'`{c}`' for c in close)}?" if close
                        else f"list its keys with `python -c 'import transformers; print(transformers.{cls.__name__}())'`")
                raise ModelBuildError(f"--set `{key}`: {cls.__name__} has no key `{part}`, so it would change nothing; "
                                      f"{hint}")
            path.append(part)
            cls = (getattr(cls, "sub_configs", None) or {}).get(part)
            if cls is None:
                break


def config_gaps(model_type: str, error: BaseException, limit: int = 6) -> list[str]:
    """The values transformers' default `model_type` config lacks, as the build `error` shows them: a config attribute
    the model reads but the config class never sets, else the keys the default leaves None (unset_config_values)."""
    import re

    found = re.search(r"'(\w+Config)' object has no attribute '(\w+)'", str(error))
    if found:
        return [f"{found.group(2)} (read from {found.group(1)}, which has no such value)"]
    try:
        return unset_config_values(build_config(model_type), limit)
    except Exception:  # noqa: BLE001 - the config itself does not build: the error says why
        return []


def unset_config_values(config, limit: int = 6) -> list[str]:
    """Keys of `config` (dotted into sub-configs) that its model type declares but leaves None, e.g. sizes transformers'
    default config has no value for; PretrainedConfig's own fields (token ids, dtype, ...) excepted."""
    import dataclasses

    from transformers import PretrainedConfig

    common = {f.name for f in dataclasses.fields(PretrainedConfig)} if dataclasses.is_dataclass(PretrainedConfig) else set()
    common |= {"pad_token_id", "bos_token_id", "eos_token_id", "sliding_window", "rope_scaling", "rope_parameters"}
    found: list[str] = []

    def visit(cfg, prefix: str) -> None:
        if not dataclasses.is_dataclass(cfg):
            return
        for f in dataclasses.fields(cfg):
            if f.name in common:
                continue
            try:
                value = getattr(cfg, f.name)
            except Exception:  # noqa: BLE001 - per-layer attributes refuse a global read; not a value to report
                continue
            if value is None:
                found.append(prefix + f.name)
            elif isinstance(value, PretrainedConfig):
                visit(value, f"{prefix}{f.name}.")

    visit(config, "")
    return found[:limit]


def _config_keys(cls) -> Optional[set]:
    """The keys a config class takes: its dataclass fields and `attribute_map` aliases (None: not a dataclass)."""
    import dataclasses

    if not dataclasses.is_dataclass(cls):
        return None
    return {f.name for f in dataclasses.fields(cls)} | set(getattr(cls, "attribute_map", {}) or {})


def _read_by_model_code(cls, key: str) -> bool:
    """Whether the modeling file beside config class `cls` reads `key` off its config although the class declares no
    such field (`getattr(config, "head_dim", hidden_size // num_attention_heads)`): a released checkpoint's
    config.json sets it, and it changes the model. The file is read as text: nothing is imported."""
    import re
    import sys
    from pathlib import Path

    path = Path(getattr(sys.modules.get(cls.__module__), "__file__", None) or "")
    if not path.name.startswith("configuration_"):
        return False
    modeling = path.with_name("modeling_" + path.name[len("configuration_"):])
    if not modeling.is_file():
        return False
    text = modeling.read_text(encoding="utf-8")
    return f'config, "{key}"' in text or re.search(rf"\bconfig\.{re.escape(key)}\b", text) is not None


def _nest(flat: dict) -> dict:
    """`{"text_config.num_hidden_layers": 4}` -> `{"text_config": {"num_hidden_layers": 4}}` (sub-config overrides)."""
    out: dict = {}
    for key, value in flat.items():
        *path, leaf = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def model_class_for(config: Any) -> Any:
    """The class users load for `config`: the family's top model (planc.models.families), else the *ForCausalLM."""
    from planc.models.families import _direct_family

    fam = _direct_family(config.model_type)
    if fam is not None and fam.head is not None:
        return fam.model_class(config)
    return causal_lm_class(config)
