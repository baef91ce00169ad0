"""The model walk `planc explain` resolves against, read from data when nothing it depends on changed.

Building a full-size model on `meta` takes seconds, nearly all of it importing torch and transformers; the compiler
and the memory model read only its walk (planc.compiler.walk_data). `explain_walk` looks for the walk under a key of
everything the walk depends on: the model type, the config values given (`--config`, `--set`), `--dtype`, the
installed transformers version, the walk format and the source of the code that builds the model and makes and reads
walks. A transformers config is a function of its model type, the values given and the transformers version, so the
key stands for the full config after overrides without building it. A hit reads JSON and imports neither torch nor
transformers; a miss builds the model, walks it and stores the walk.

Where walks are: the user's cache (`$XDG_CACHE_HOME/planc/walks`, else `~/.cache/planc/walks`), then the walks of the
shipped plans' default configs that ship with planc (planc/models/walks/, written by `python -m
planc.models.walk_cache`; tests/models/test_walk_cache.py fails when they are stale), so a first run from a fresh
clone is fast too. `PLANC_WALK_CACHE=off` reads and writes none. A file that does not parse or whose key differs is
a miss; no code runs from any of them (JSON only).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Optional

CACHE_ENV = "PLANC_WALK_CACHE"
KEEP = 64  # walks kept in the user's cache (the most recently written); a walk is 50-200 KB
SHIPPED = Path(__file__).resolve().parent / "walks"
# keys of a saved config.json that are metadata, not constructor arguments
CONFIG_METADATA = ("model_type", "architectures", "transformers_version", "auto_map", "_name_or_path")
# the code that builds the model, makes and reads a walk: its source is part of the key
_WALK_CODE = ("compiler/walk.py", "compiler/walk_data.py", "models/walk_cache.py", "models/build.py")


def enabled() -> bool:
    return os.environ.get(CACHE_ENV, "").strip().lower() not in ("off", "0", "no", "false")


def cache_dir() -> Optional[Path]:
    """The user's walk cache; None without an absolute XDG_CACHE_HOME or a home directory (nowhere to keep one)."""
    base = os.environ.get("XDG_CACHE_HOME") or ""
    if not os.path.isabs(base):  # the XDG spec: a relative path is ignored
        home = os.path.expanduser("~")
        if not os.path.isabs(home):
            return None
        base = os.path.join(home, ".cache")
    return Path(base) / "planc" / "walks"


def _version(package: str) -> Optional[str]:
    """The `__version__` of the `package` an import would load, read from its source without importing it (a checkout
    on PYTHONPATH may differ from the installed distribution's metadata); None when it is not there."""
    import importlib.util
    import re

    try:
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            return None
        with open(spec.origin, encoding="utf-8") as f:
            found = re.search(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", f.read(), re.MULTILINE)
    except (ImportError, OSError, ValueError):
        return None
    return found.group(1) if found else None


def _code_digest() -> Optional[str]:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    try:
        for name in _WALK_CODE:
            h.update((root / name).read_bytes())
    except OSError:  # the source is not there to read (a zipped install): no key, nothing stored
        return None
    return h.hexdigest()[:16]


def walk_key(model_type: str, config: dict, dtype: str) -> Optional[dict]:
    """The key of the walk of `model_type` built from `config` (constructor values) in `dtype`; None when a config value
    is not plain data or transformers or the walk code cannot be read (the walk is then always built)."""
    from planc.compiler.walk_data import WALK_FORMAT, Unencodable, encode

    try:
        values = encode({k: v for k, v in config.items() if k not in CONFIG_METADATA})
    except Unencodable:
        return None
    code, transformers = _code_digest(), _version("transformers")
    if code is None or transformers is None:
        return None
    return {"format": WALK_FORMAT, "code": code, "transformers": transformers, "model_type": model_type,
            "config": values, "dtype": dtype}


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def _read(path: Path, key: dict):
    """The walk stored at `path` under `key`, else None (missing, unreadable, another key)."""
    from planc.compiler.walk_data import walk_from_data

    try:
        with open(path, encoding="utf-8") as f:
            stored = json.load(f)
        if not isinstance(stored, dict) or stored.get("key") != key:
            return None
        return walk_from_data(stored["walk"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):  # not a walk this planc wrote
        return None


def cached_walk(key: dict):
    """The stored walk for `key`: the user's cache, then the shipped walk of the model type; None on a miss."""
    user = cache_dir()
    stored = _read(user / f"{_digest(key)}.json", key) if user is not None else None
    return stored or _read(SHIPPED / f"{key['model_type']}.json", key)


def render(key: dict, walk) -> Optional[str]:
    """The file text of `walk` under `key`, one module a line (a readable diff); None when the walk's config is not
    plain data."""
    from planc.compiler.walk_data import Unencodable, walk_to_data

    try:
        data = walk_to_data(walk)
    except Unencodable:
        return None
    modules = data.pop("modules")
    head = json.dumps({"key": key, "walk": data}, sort_keys=True)
    lines = ",\n".join(json.dumps(m) for m in modules)
    return head[:-2] + ', "modules": [\n' + lines + "\n]}}\n"


def store_walk(key: dict, walk) -> None:
    """Write `walk` to the user's cache under `key`, keeping the KEEP most recent walks; a cache that cannot be written
    is skipped, never an error."""
    text, user = render(key, walk), cache_dir()
    if text is None or user is None:
        return
    path = user / f"{_digest(key)}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
        stored = sorted(path.parent.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in stored[KEEP:]:
            old.unlink()
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass


def meta_model_at(model_type: str, config: dict, dtype: str):
    """The model users load for `config` on the meta device (planc.models.build.meta_model) in the dtype the byte
    counts should use (`config`: the config's own, else bfloat16), built in it as `from_pretrained(dtype=)` builds
    it: the modules transformers keeps in fp32 (`_keep_in_fp32_modules`, e.g. DeepSeek-V3's router) stay fp32, and
    the byte counts show them so."""
    import torch

    from planc.models.build import meta_model, overridden_config

    kwargs = {k: v for k, v in config.items() if k not in CONFIG_METADATA}
    built = overridden_config(model_type, kwargs)
    if dtype == "config":
        name = getattr(built, "dtype", None) or kwargs.get("torch_dtype") or "bfloat16"
        dtype = str(name).replace("torch.", "")
    resolved = getattr(torch, dtype)
    if not isinstance(resolved, torch.dtype):
        raise TypeError(f"{dtype!r} is not a torch dtype")
    return meta_model(built, dtype=resolved)


def explain_walk(model_type: str, config: dict, dtype: str, overrides: Optional[dict] = None):
    """The walk of `meta_model_at(model_type, config, dtype)`: stored, or built, walked and stored. `overrides` (the
    `--set` keys among `config`) are checked against the config class when the model is built; a stored walk was
    built, so they were. Raises what building raises (ModelBuildError, and ValueError/TypeError/AttributeError for a
    dtype torch does not have)."""
    from planc.compiler.walk import walk_model
    from planc.models.build import check_override_keys

    key = walk_key(model_type, config, dtype) if enabled() else None
    if key is not None:
        walk = cached_walk(key)
        if walk is not None:
            return walk
    check_override_keys(model_type, overrides or {})
    walk = walk_model(meta_model_at(model_type, config, dtype))
    if key is not None:
        store_walk(key, walk)
    return walk


def shipped_model_types() -> list[str]:
    """The model types of the shipped plans (`model.type` of plans/*.yaml)."""
    from planc.lint.plan_loader import load_plan
    from planc.spec.shipped import shipped_plans

    return sorted({load_plan(path).plan.model.type for path in shipped_plans()})


def render_shipped(model_type: str) -> Optional[str]:
    """The shipped walk file of `model_type`'s default config (what `planc explain PLAN` builds), from the live walk."""
    from planc.compiler.walk import walk_model

    key = walk_key(model_type, {}, "config")
    assert key is not None
    return render(key, walk_model(meta_model_at(model_type, {}, "config")))


def main() -> int:
    """`python -m planc.models.walk_cache`: rewrite planc/models/walks/ for the installed transformers."""
    SHIPPED.mkdir(exist_ok=True)
    wanted = shipped_model_types()
    for stale in SHIPPED.glob("*.json"):
        if stale.stem not in wanted:
            stale.unlink()
    for model_type in wanted:
        text = render_shipped(model_type)
        if text is None:
            sys.stdout.write(f"{model_type}: its config is not plain data; not shipped\n")
            continue
        (SHIPPED / f"{model_type}.json").write_text(text, encoding="utf-8")
        sys.stdout.write(f"wrote {SHIPPED / model_type}.json\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
