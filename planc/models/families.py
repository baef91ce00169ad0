"""The MoE families of the installed transformers, found at run time, and the model each one is built as.

A *family* is a config class that declares transformers' own expert parallelism: a non-empty
`base_model_ep_plan`, or a `base_model_tp_plan` that names experts. The family's plans are written
relative to its base model (`layers.*...`). The model planc shards is the *top* model users load:
the `*ForCausalLM` of the config when there is one, otherwise the multimodal model whose config holds
this one as a sub-config (`Qwen3VLMoeForConditionalGeneration` holds `Qwen3VLMoeTextConfig`), or the
model of another task head. `plan_prefix` is the path of the base model inside that top model, found
by walking a meta-device instance (not from `base_model_prefix`, which says `language_model` for
Llama 4 while the module is `model`).

One source of truth for `planc init`, the family sweep test and docs/models.md: nothing here is a
hard-coded list of families.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Optional

from planc.errors import ModelBuildError

# Task heads tried in order for the top model; the first mapping that knows the type wins.
_HEADS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
    "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_MAPPING_NAMES",
)


@dataclass(frozen=True)
class Family:
    """One MoE config class and how planc builds and plans the model it belongs to."""

    text_type: str  # the config class's model_type, whose plans transformers declares (qwen3_vl_moe_text)
    model_type: str  # config.model_type of the top model; a plan's `model.type` (qwen3_vl_moe)
    config_path: tuple[str, ...]  # attributes from the top config to the family's config (("text_config",))
    head: Optional[str]  # the auto mapping the top model class comes from; None: no task head builds it

    @property
    def multimodal(self) -> bool:
        return bool(self.config_path)

    def config_class(self):
        from transformers import CONFIG_MAPPING

        return CONFIG_MAPPING[self.text_type]

    def top_config_class(self):
        from transformers import CONFIG_MAPPING

        return CONFIG_MAPPING[self.model_type]

    def model_class(self, config):
        from transformers.models.auto import modeling_auto

        if self.head is None:
            raise ModelBuildError(f"transformers has no task head that builds a `{self.model_type}` model")
        names = getattr(modeling_auto, self.head)
        name = names[self.model_type]
        return getattr(__import__("transformers", fromlist=[name]), name)


def declares_experts_plan(config_cls) -> bool:
    """transformers shards this config's experts: an EP plan, or a TP plan with rules on experts."""
    ep = getattr(config_cls, "base_model_ep_plan", None) or {}
    tp = getattr(config_cls, "base_model_tp_plan", None) or {}
    return bool(ep) or any("experts" in k for k in tp)


def _sub_config_paths(config_cls, depth: int = 0):
    """(path, config class) for every sub-config reachable from `config_cls` (thinker_config.text_config...)."""
    if depth > 3:
        return
    for attr, sub in (getattr(config_cls, "sub_configs", None) or {}).items():
        if isinstance(sub, type):
            yield (attr,), sub
            for path, deeper in _sub_config_paths(sub, depth + 1):
                yield (attr, *path), deeper


def _head_for(model_type: str) -> Optional[str]:
    from transformers.models.auto import modeling_auto

    for head in _HEADS:
        if model_type in getattr(modeling_auto, head):
            return head
    return None


def _top_head_for(model_type: str) -> Optional[str]:
    """The first task head whose model class is built from `model_type`'s own config class: `dots3_note` is
    in the causal-LM mapping with a class that takes only its text config; the model holding every tower
    is the image-text-to-text one."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto

    first = None
    for head in _HEADS:
        name = getattr(modeling_auto, head).get(model_type)
        if name is None or head == "MODEL_MAPPING_NAMES" and first is not None:
            continue
        first = first or head
        try:
            cls = getattr(__import__("transformers", fromlist=[name]), name)
        except Exception:  # noqa: BLE001 - a class that does not import: not this head
            continue
        if getattr(cls, "config_class", None) is CONFIG_MAPPING[model_type]:
            return head
    return first


@cache
def moe_families() -> tuple[Family, ...]:
    """Every family of the installed transformers, sorted by `text_type`."""
    from transformers import CONFIG_MAPPING

    configs = {}
    for mt in CONFIG_MAPPING.keys():
        try:
            configs[mt] = CONFIG_MAPPING[mt]
        except Exception:  # noqa: BLE001 - a model type whose module fails to import is not ours to judge
            continue
    parents: dict[type, tuple[str, tuple]] = {}
    for mt, cls in configs.items():
        if _head_for(mt) is None or _head_for(mt) == "MODEL_MAPPING_NAMES":
            continue
        for path, sub in _sub_config_paths(cls):
            prev = parents.get(sub)
            if prev is None or len(path) < len(prev[1]):
                parents[sub] = (mt, path)
    out = []
    for mt, cls in configs.items():
        if not declares_experts_plan(cls):
            continue
        head = _head_for(mt)
        if head is not None and head != "MODEL_MAPPING_NAMES":
            out.append(Family(mt, mt, (), head))  # a model of its own with a task head
        elif cls in parents:
            top, path = parents[cls]
            out.append(Family(mt, top, path, _top_head_for(top)))  # the language model of a multimodal model
        else:
            out.append(Family(mt, mt, (), head or "MODEL_MAPPING_NAMES"))  # only a base model
    return tuple(sorted(out, key=lambda f: f.text_type))


def _direct_family(model_type: str) -> Optional[Family]:
    """The family of `model_type` found from its own config class alone (no scan of every model type)."""
    from transformers import CONFIG_MAPPING

    try:
        cls = CONFIG_MAPPING[model_type]
    except (KeyError, ValueError):
        return None
    head = _head_for(model_type)
    if head is None or head == "MODEL_MAPPING_NAMES":
        if declares_experts_plan(cls):
            return None  # the language model of a multimodal model: its parent needs the scan
        head = head if head else None
    if declares_experts_plan(cls):
        return Family(model_type, model_type, (), head)
    if head is None:
        return None
    subs = [(path, sub) for path, sub in _sub_config_paths(cls) if declares_experts_plan(sub)]
    if subs:
        path, sub = min(subs, key=lambda ps: len(ps[0]))
        return Family(getattr(sub, "model_type", "") or path[-1], model_type, path, _top_head_for(model_type))
    return None


def family(model_type: str) -> Family:
    """The family whose top model or own config is `model_type` (`qwen3_vl_moe` or `qwen3_vl_moe_text`)."""
    direct = _direct_family(model_type)
    if direct is not None:
        return direct
    fams = moe_families()
    for f in fams:
        if f.text_type == model_type and not f.multimodal:
            return f
    for f in fams:
        if f.model_type == model_type:
            return f
    for f in fams:
        if f.text_type == model_type:
            return f
    raise KeyError(model_type)


def text_config_of(fam: Family, config):
    for attr in fam.config_path:
        config = getattr(config, attr)
    return config


def base_model_paths(model, text_config_cls) -> list[str]:
    """Paths of the modules that carry the family's plans: every base model whose config is `text_config_cls`.

    transformers prefixes a child's plans with the child's path; the children are the outermost modules
    whose `config` is an instance of the family's config class and that hold the decoder layers (a
    diffusion model holds two: its encoder's language model and its decoder), else the outermost such module.
    """
    found: list[str] = []
    for name, module in model.named_modules():
        if not name or not hasattr(module, "layers") or any(name.startswith(f + ".") or name == f for f in found):
            continue
        cfg = getattr(module, "config", None)
        # a stack of the family's layers under a module whose config is another one (a diffusion decoder
        # built from the top config): the family's plans apply to it as they apply to the base model
        if isinstance(cfg, text_config_cls) or any(
            isinstance(getattr(m, "config", None), text_config_cls) for m in module.layers.modules()
        ):
            found.append(name)
    if found:
        return found
    for with_layers in (True, False):
        for name, module in model.named_modules():
            cfg = getattr(module, "config", None)
            if not name or not isinstance(cfg, text_config_cls) or (with_layers and not hasattr(module, "layers")):
                continue
            if not any(name.startswith(f + ".") for f in found):
                found.append(name)
        if found:
            return found
    return found
