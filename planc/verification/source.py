"""Where the model under verification comes from: a transformers model type, a local directory, or a user function.

- `type`: a transformers family's default config (`--model-type mixtral`), `--set` overrides on top;
- `dir`: a local checkpoint or config directory (`--model DIR`): its config.json, and its own modeling code where
  `trust_remote_code` is given (no weights are read: verify compares random weights);
- `build`: `pkg.module:function` (or a module-level callable) returning a fresh, seeded `nn.Module`: the way to
  verify custom modeling code. It is called on every rank with the same seed; its model runs at its own widths.

A source is picklable: every rank builds its model from it with the same seed, so the sharded model and its
unsharded twin start from the same weights in every process.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from planc.errors import ModelBuildError, VerifyError, one_line

BuildTarget = Union[str, Callable[[], Any]]


@dataclass(frozen=True)
class ModelSource:
    """The model to verify; `overrides` are `--set` config values (type and dir sources)."""

    kind: str  # "type", "dir" or "build"
    value: Any  # a model type, a directory, or a build target
    trust_remote_code: bool = False
    overrides: dict = field(default_factory=dict)

    def describe(self) -> str:
        if self.kind == "type":
            return f"transformers `{self.value}` (its default config{self._set()})"
        if self.kind == "dir":
            return f"the config in {self.value}{self._set()}" + (" with its own modeling code" if self.trust_remote_code
                                                                  else "")
        return f"--build {target_name(self.value)}"

    def _set(self) -> str:
        return ", " + ", ".join(f"{k}={v}" for k, v in self.overrides.items()) if self.overrides else ""

    def full_config(self) -> Any:
        """The config the user runs (full widths); VerifyError naming the source when it cannot be read or built."""
        from planc.models.build import check_override_keys, overridden_config

        if self.kind == "type":
            try:
                check_override_keys(self.value, self.overrides)
                return overridden_config(self.value, self.overrides)
            except ModelBuildError as e:
                raise VerifyError(f"--model-type {self.value}: {e}") from None
        if self.kind == "dir":
            return _dir_config(self.value, self.trust_remote_code, self.overrides)
        raise TypeError("a --build source has no config of its own")


def _dir_config(directory: str, trust_remote_code: bool, overrides: dict) -> Any:
    import os

    from transformers import AutoConfig

    if not os.path.isdir(directory) or not os.path.isfile(os.path.join(directory, "config.json")):
        raise VerifyError(f"--model {directory}: not a directory with a config.json; pass a checkpoint or config "
                          "directory as save_pretrained writes it, or --model-type / --build")
    try:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises anything from a config it cannot read
        hint = " (its config names custom code: add --trust-remote-code if you trust it)" \
            if "trust_remote_code" in str(e) else ""
        raise VerifyError(f"--model {directory}: transformers cannot read its config: "
                          f"{type(e).__name__}: {one_line(e, 300)}{hint}") from None
    for key, value in overrides.items():
        target = config
        *path, leaf = key.split(".")
        for part in path:
            target = getattr(target, part, None)
        if target is None or not hasattr(target, leaf):
            raise VerifyError(f"--set {key}: the config in {directory} has no key `{key}`, so it would change nothing")
        setattr(target, leaf, value)
    return config


def target_name(target: BuildTarget) -> str:
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(target))}"


def resolve_build(target: BuildTarget) -> Callable[[], Any]:
    """The callable a `--build` target names; VerifyError when it is malformed, not importable or not callable."""
    if callable(target):
        if "<locals>" in getattr(target, "__qualname__", "") or getattr(target, "__name__", "") == "<lambda>":
            raise VerifyError(f"build target {target_name(target)}: every rank imports it by name, so it must be a "
                              "module-level function (not a lambda or a nested function)")
        return target
    module_name, sep, attr = str(target).partition(":")
    if not sep or not module_name or not attr:
        raise VerifyError(f"--build {target!r}: write pkg.module:function, a module-level function that returns a "
                          "fresh, seeded torch.nn.Module")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything at import
        raise VerifyError(f"--build {target}: cannot import `{module_name}`: {type(e).__name__}: "
                          f"{one_line(e, 300)} (is its directory on PYTHONPATH?)") from None
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise VerifyError(f"--build {target}: `{module_name}` has no attribute `{attr}`")
    if not callable(fn):
        raise VerifyError(f"--build {target}: `{attr}` is a {type(fn).__name__}, not a function returning a model")
    return fn


def call_build(target: BuildTarget, seed: int) -> Any:
    """The module a build target returns, seeded with `seed` first; VerifyError when it raises or returns no module."""
    import torch

    fn = resolve_build(target)
    torch.manual_seed(seed)
    try:
        model = fn()
    except Exception as e:  # noqa: BLE001 - the user's function may raise anything
        raise VerifyError(f"--build {target_name(target)} raised {type(e).__name__}: {one_line(e, 300)}") from None
    if not isinstance(model, torch.nn.Module):
        raise VerifyError(f"--build {target_name(target)} returned a {type(model).__name__}, not a torch.nn.Module")
    return model.eval()


def build_model(source: ModelSource, config: Optional[Any], seed: int) -> Any:
    """The model every rank builds (fp32, eval mode, the same weights for the same seed): from `config` (the shrunk
    config of a type or dir source) or from the build target."""
    from planc.models.build import build_random_model

    if source.kind == "build":
        return call_build(source.value, seed)
    try:
        return build_random_model(config, seed=seed, trust_remote_code=source.trust_remote_code)
    except ModelBuildError as e:
        raise VerifyError(f"{source.describe()}: {e}") from None
