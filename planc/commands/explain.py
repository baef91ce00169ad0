"""`planc explain PLAN`: resolve a plan against the real module tree of its model, without weights.

The model named by `model.type` is built on the `meta` device from transformers' default config for
that type (or `--config config.json`), with `--set key=value` overrides, so a 600B-parameter model
costs no memory. Prints what each rule matched, the EP strategy and why, and the bytes per rank.

Exit status: 0 the plan resolves, 1 it does not (the CompileError or lint errors are printed),
2 usage errors (unreadable --config, bad --set, unknown model type).
"""

from __future__ import annotations

import argparse
import sys

DTYPES = ("config", "float32", "bfloat16", "float16")
# keys of a saved config.json that are metadata, not constructor arguments
_CONFIG_METADATA = ("model_type", "architectures", "transformers_version", "auto_map", "_name_or_path")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plans", nargs="+", metavar="PLAN", help="plan file(s) (YAML); pre-commit passes several")
    parser.add_argument("--config", metavar="CONFIG_JSON", help="a model config.json instead of the default config")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value (YAML scalar), e.g. --set num_hidden_layers=4; repeatable",
    )
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="config",
        help="parameter dtype for the byte counts (default: the config's dtype, else bfloat16)",
    )
    parser.add_argument(
        "--checkpoint", metavar="DIR",
        help="a local checkpoint directory: its config.json builds the model, and the bytes each rank reads "
        "from its safetensors files are printed by dtype",
    )
    parser.add_argument(
        "--train", action="store_true",
        help="also print what each rank holds while training with AdamW: parameters, gradients and optimizer "
        "state at the plan's sizes and `training.data_parallel` (replicate or fsdp, mixed precision)",
    )
    parser.add_argument(
        "--device-memory", metavar="SIZE",
        help="memory of the device each rank loads onto (e.g. 141GiB, 80GB): a plan whose per-rank shard does "
        "not fit is refused (PLC660)",
    )


def parse_overrides(items: list[str]) -> dict:
    """`key=value` pairs; values are read like plan values, YAML 1.2 (`4` -> 4, `true` -> True, `[1,2]` ->
    list), and a value YAML 1.1 tools would read differently (`010`, `on`) is refused like in a plan."""
    from planc.spec.source import SourceError, parse_yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: write KEY=VALUE, e.g. --set num_hidden_layers=4")
        try:
            doc = parse_yaml(value)
        except SourceError as e:
            raise ValueError(f"--set {item!r}: {e.message}") from None
        if doc.problems:
            raise ValueError(f"--set {item!r}: {doc.problems[0].message}; {doc.problems[0].hint}")
        out[key.strip()] = doc.data
    return out


def read_config(path: str) -> dict:
    import json

    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config.json holds a JSON object")
    return data


def build_model(model_type: str, config: dict, dtype: str):
    """The `*ForCausalLM` on the meta device, cast to the dtype the byte counts should use."""
    import torch

    from planc.runtime.models import build_meta_model

    kwargs = {k: v for k, v in config.items() if k not in _CONFIG_METADATA}
    model = build_meta_model(model_type, kwargs)
    if dtype == "config":
        name = getattr(model.config, "dtype", None) or kwargs.get("torch_dtype") or "bfloat16"
        dtype = str(name).replace("torch.", "")
    return model.to(getattr(torch, dtype))


def run(args: argparse.Namespace) -> int:
    import json

    from planc.compiler.render import json_data, render_text

    from planc.compiler.memory import budget, budget_problems, parse_size

    try:
        overrides = parse_overrides(args.overrides)
        config_path = args.config or (f"{args.checkpoint}/config.json" if args.checkpoint else None)
        config = read_config(config_path) if config_path else {}
        device_memory = parse_size(args.device_memory) if args.device_memory else None
    except (OSError, ValueError) as e:
        sys.stderr.write(f"planc explain: {e}\n")
        return 2
    status, compiled, budgets, trains = 0, [], [], []
    for path in args.plans:
        rc, c = explain_one(path, config, overrides, args.dtype)
        status = max(status, rc)
        if c is None:
            continue
        try:
            reads = _checkpoint_reads(args.checkpoint, c, config, overrides, args.dtype) if args.checkpoint else None
        except Exception as e:  # noqa: BLE001 - a checkpoint that cannot be read is the user's to fix
            sys.stderr.write(f"planc explain: {e}\n")
            return 2
        problems = budget_problems(c, device_memory, where=path) if device_memory is not None else []
        for p in problems:
            sys.stderr.write(f"planc explain: {p.where}: {p.code} {p.message}\n      hint: {p.hint}\n")
            status = max(status, 1)
        compiled.append(c)
        budgets.append(budget(c, device_memory, reads))
        trains.append(_train_memory(c, config, overrides, args.dtype) if args.train else None)
    if args.format == "json":
        data = [
            {**json_data(c), "memory": _budget_json(b), **({"train": t.to_json()} if t is not None else {})}
            for c, b, t in zip(compiled, budgets, trains)
        ]
        sys.stdout.write(json.dumps(data[0] if len(args.plans) == 1 and data else data, indent=2, sort_keys=True) + "\n")
    else:
        text = [
            render_text(c) + "\n" + b.render() + (f"\n{t.render()}" if t is not None else "")
            for c, b, t in zip(compiled, budgets, trains)
        ]
        sys.stdout.write("\n\n".join(text) + ("\n" if compiled else ""))
    return status


def _train_memory(compiled, config: dict, overrides: dict, dtype: str):
    """`--train`: what each rank holds training with AdamW under the plan (planc.compiler.train_memory)."""
    from planc.compiler.train_memory import train_memory

    model = build_model(config.get("model_type") or compiled.model_type, {**config, **overrides}, dtype)
    return train_memory(compiled, model)


def _budget_json(b) -> dict:
    return {
        "hold_per_rank": dict(b.hold),
        "read_per_rank": dict(b.read) if b.read is not None else None,
        "device_memory": b.device_memory,
    }


def _checkpoint_reads(directory: str, compiled, config: dict, overrides: dict, dtype: str):
    """Bytes each rank reads from `directory`'s safetensors files, by checkpoint dtype (headers only)."""
    from planc.compiler.memory import read_per_rank
    from planc.runtime.checkpoint.files import CheckpointFiles
    from planc.runtime.checkpoint.keys import target_reads

    model = build_model(config.get("model_type") or compiled.model_type, {**config, **overrides}, dtype)
    files = CheckpointFiles.open(directory)
    try:
        return read_per_rank(compiled, target_reads(model, files))
    finally:
        files.close()


def explain_one(path: str, config: dict, overrides: dict, dtype: str):
    """(exit status, CompiledPlan or None) for one plan file; the problems go to stderr."""
    from planc.compiler.resolve import compile_plan
    from planc.errors import CompileError, PlanError
    from planc.lint.load import load_plan

    from planc.lint.rules_source import UNREADABLE_CODES
    from planc.runtime.models import ModelBuildError

    try:
        loaded = load_plan(path)
    except PlanError as e:
        if any(d.code in UNREADABLE_CODES for d in e.diagnostics):  # like `planc lint`: unreadable input is 2
            sys.stderr.write(f"planc explain: cannot read {path}:\n{e}\n")
            return 2, None
        sys.stderr.write(f"planc explain: {path} does not lint clean:\n{e}\n")
        return 1, None
    except (OSError, TypeError) as e:
        sys.stderr.write(f"planc explain: cannot read {path}: {e}\n")
        return 2, None
    model_type = config.get("model_type") or loaded.plan.model.type
    try:
        model = build_model(model_type, {**config, **overrides}, dtype)
    except ModelBuildError as e:  # one line that names the model type (planc.runtime.models)
        sys.stderr.write(f"planc explain: {e}\n")
        return 2, None
    except (ValueError, TypeError, AttributeError) as e:  # a --dtype the config names that torch does not have
        sys.stderr.write(f"planc explain: cannot build a `{model_type}` model: {e}\n")
        return 2, None
    try:
        compiled = compile_plan(model, loaded)
    except CompileError as e:
        sys.stderr.write(f"planc explain: {path} does not resolve against {type(model).__name__}:\n{e}\n")
        return 1, None
    return 0, compiled
