"""`planc explain PLAN`: resolve a plan against the real module tree of its model, without weights.

The model named by `model.type` is built on the `meta` device from transformers' default config for
that type (or `--config config.json`), with `--set key=value` overrides, so a 600B-parameter model
costs no memory. Prints what each rule matched, the EP strategy and why, and the bytes per rank.

`--checkpoint DIR` runs every check planc.load runs before reading a byte (the same function; for a planc.save
checkpoint also planc.load_optimizer's reading of its optimizer state, as data), and
`--parallel tp_size=2,ep_size=2` explains the plan at the sizes planc.apply/load(parallel=...) would run it.

Exit status: 0 the plan resolves, 1 it does not (the CompileError or lint errors are printed) or planc.load
would refuse the checkpoint (every problem listed), 2 usage errors (unreadable --config, bad --set or
--parallel, unknown model type).
"""

from __future__ import annotations

import argparse
import os
import sys

DTYPES = ("config", "float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from planc.compiler.devices import CARDS
    from planc.compiler.optimizer_step import STEPS
    from planc.compiler.peak_memory import DEVICE_TYPES

    cards = ", ".join(c.name for c in CARDS.values())
    parser.add_argument("plans", nargs="+", metavar="PLAN", help="plan file(s) (YAML); pre-commit passes several")
    parser.add_argument("--config", metavar="CONFIG_JSON", help="a model config.json instead of the default config")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value (YAML scalar), e.g. --set num_hidden_layers=4; repeatable",
    )
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format")
    parser.add_argument(
        "--quiet", action="store_true",
        help="print only the problems (on stderr), no tables: what a pre-commit hook shows, the failing plans",
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default="config",
        help="parameter dtype for the byte counts (default: the config's dtype, else bfloat16)",
    )
    parser.add_argument(
        "--checkpoint", metavar="DIR",
        help="a local checkpoint directory: its config.json builds the model, every check planc.load runs before "
        "reading is run (keys, shapes, dtypes, experts; exit 1 listing what it would refuse), and the bytes each "
        "rank reads from its safetensors files are printed by dtype",
    )
    parser.add_argument(
        "--trust-checkpoint-code", action="store_true",
        help="read a planc.save checkpoint with torch's own unpickler instead of planc's allow-list: code in a "
        "hostile checkpoint runs. Only for a checkpoint you trust that planc cannot read (docs/security.md)",
    )
    parser.add_argument(
        "--parallel", metavar="SIZES",
        help="explain the plan at other sizes, as planc.apply/planc.load(parallel=...) run it, e.g. "
        "--parallel tp_size=2,ep_size=2",
    )
    parser.add_argument(
        "--train", action="store_true",
        help="also print what each rank holds while training with AdamW: parameters, gradients and optimizer "
        "state at the plan's sizes and `training.data_parallel` (replicate or fsdp, mixed precision)",
    )
    parser.add_argument(
        "--serve", action="store_true",
        help="print each rank's peak memory serving one prefill of --batch x --seq (KV cache, transients)",
    )
    parser.add_argument("--batch", metavar="B", help="micro-batch per dp replica for the peak memory (default 1)")
    parser.add_argument(
        "--seq", metavar="S",
        help="sequence length for the peak memory; `auto` with --device-memory: the longest that fits",
    )
    parser.add_argument(
        "--capacity-factor", metavar="F", default="1.0",
        help="EP routing: rows a rank receives relative to a balanced load (default 1.0; the worst case is printed)",
    )
    parser.add_argument(
        "--optimizer", choices=STEPS,
        help="how AdamW steps (--train), overriding the step the plan leads torch to on CUDA (printed under the "
        "training table): foreach holds one more copy of exp_avg_sq per dtype group, for-loop (CPU's default) two "
        "copies of the largest parameter's, fused none",
    )
    parser.add_argument(
        "--device-type", choices=DEVICE_TYPES, default="cuda",
        help="where the workload runs (default cuda): cuda prices torch's CUDA AdamW step and cuBLAS workspaces, cpu "
        "(as planc verify --memory measures) the for-loop step and no workspaces",
    )
    parser.add_argument(
        "--reserve", metavar="SIZE",
        help="memory each rank loses outside PyTorch's allocator (CUDA context, NCCL); default 2GiB",
    )
    parser.add_argument(
        "--device-memory", metavar="SIZE|CARD",
        help=f"memory of the device each rank loads onto: a card ({cards}: the memory torch reports for it), or a "
        "size (80GiB = 80 * 2^30 bytes, 80GB = 80 * 10^9 bytes); the output says how it was read. A plan whose "
        "per-rank shard does not fit is refused (PLC660)",
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


_SIZES = ("tp_size", "ep_size", "dp_size")


def parse_parallel(text: str | None) -> dict | None:
    """`tp_size=2,ep_size=2` -> {"tp_size": 2, "ep_size": 2} (the `parallel=` of planc.apply and planc.load)."""
    if not text:
        return None
    out = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or key.strip() not in _SIZES or not value.strip().isdigit():
            raise ValueError(
                f"--parallel {text!r}: write comma-separated SIZE=N with SIZE one of {', '.join(_SIZES)}, "
                "e.g. --parallel tp_size=2,ep_size=2"
            )
        out[key.strip()] = int(value)
    return out


def read_config(path: str) -> dict:
    import json

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError as e:
        raise ValueError(
            f"{path}: not valid JSON ({e}); a config.json is a JSON object as save_pretrained writes it"
        ) from None
    except OSError as e:
        raise OSError(f"{path}: cannot be read ({e.strerror or e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config.json holds a JSON object")
    return data


def _meta_model_at(model_type: str, config: dict, dtype: str):
    """The meta model explain resolves against (planc.models.walk_cache.meta_model_at)."""
    from planc.models.walk_cache import meta_model_at

    return meta_model_at(model_type, config, dtype)


def run(args: argparse.Namespace) -> int:
    import json

    from planc.compiler.render import json_data, render_text

    from planc.compiler.devices import read_device_memory
    from planc.compiler.memory_hints import activations_note
    from planc.compiler.memory import budget, budget_problems
    from planc.compiler.train_memory import train_memory

    if args.checkpoint and not os.path.isdir(args.checkpoint):  # before reading its config.json: say what it is
        from pathlib import Path

        from planc.checkpoint.files import missing_directory

        sys.stderr.write(f"planc explain: {missing_directory(Path(args.checkpoint))}\n")
        return 2
    try:
        workload = parse_workload(args)
        overrides = parse_overrides(args.overrides)
        config_path = args.config or (f"{args.checkpoint}/config.json" if args.checkpoint else None)
        config = read_config(config_path) if config_path else {}
        device = read_device_memory(args.device_memory) if args.device_memory else None
        device_memory = device.bytes if device is not None else None
        if workload is not None and device is not None and device.card is not None:
            workload["capability"] = device.card.capability  # the card's cuBLAS workspace size
        parallel = parse_parallel(args.parallel)
    except (OSError, ValueError) as e:
        sys.stderr.write(f"planc explain: {e}\n")
        return 2
    status, compiled, budgets, trains, peaks = 0, [], [], [], []
    for path in args.plans:
        rc, loaded = load_one(path, parallel)
        c, walk = None, None
        if loaded is not None:
            rc, c, walk = compile_one(path, loaded, config, overrides, args.dtype)
        status = max(status, rc)
        if loaded is None or c is None:
            continue
        reads = None
        if args.checkpoint:
            rc, reads = check_checkpoint(args.checkpoint, path, loaded, args.dtype, c, args.trust_checkpoint_code)
            status = max(status, rc)
        problems = budget_problems(c, device_memory, where=path, train=args.train) if device_memory is not None else []
        for p in problems:
            sys.stderr.write(f"planc explain: {p.where}: {p.code} {p.message}\n      hint: {p.hint}\n")
            status = max(status, 1)
        compiled.append(c)
        budgets.append(budget(c, device_memory, reads, device.how if device is not None else None))
        train = train_memory(c, walk) if args.train else None
        trains.append(train)
        peak = None
        if workload is not None:
            peak = workload_peak(c, walk, train, workload, device_memory, path)
            if peak.fits is False:
                status = max(status, 1)
        peaks.append(peak)
    if args.quiet:
        return status
    if args.format == "json":
        data = [
            {**json_data(c), "memory": {**_budget_json(b), **(m.to_json() if m is not None else {})},
             **({"train": t.to_json()} if t is not None else {})}
            for c, b, t, m in zip(compiled, budgets, trains, peaks)
        ]
        sys.stdout.write(json.dumps(data[0] if len(args.plans) == 1 and data else data, indent=2, sort_keys=True) + "\n")
    else:
        note = activations_note(workload is not None)
        text = [
            render_text(c) + "\n" + b.render() + (f"\n{t.render()}" if t is not None else "")
            + (f"\n{note}" if t is not None and note else "")
            + (f"\n{m.render()}" if m is not None else "")
            for c, b, t, m in zip(compiled, budgets, trains, peaks)
        ]
        sys.stdout.write("\n\n".join(text) + ("\n" if compiled else ""))
    return status


def parse_workload(args) -> dict | None:
    """--train/--serve with --batch/--seq -> the workload of the peak memory, or None (no --batch/--seq/--serve)."""
    from planc.compiler.memory import parse_size

    if args.serve and args.train:
        raise ValueError("--serve and --train ask for different peaks: give one of them")
    if not (args.serve or args.batch is not None or args.seq is not None):
        return None
    if not (args.serve or args.train):
        raise ValueError("--batch/--seq size a workload: add --train (a training step) or --serve (a prefill)")

    def positive(flag: str, text, default: int) -> int:
        if text is None:
            return default
        if not str(text).isdigit() or int(text) < 1:
            raise ValueError(f"{flag} {text!r}: write a positive integer, e.g. {flag} 4")
        return int(text)

    auto = args.seq == "auto"
    if auto and not args.device_memory:
        raise ValueError("--seq auto searches the longest sequence that fits: give --device-memory too")
    try:
        factor = float(args.capacity_factor)
    except ValueError:
        factor = 0.0
    if not factor >= 1.0:
        raise ValueError(f"--capacity-factor {args.capacity_factor!r}: write a number >= 1.0 (1.0: balanced routing)")
    return {
        "workload": "train" if args.train else "serve",
        "batch": positive("--batch", args.batch, 1),
        "seq": 1 if auto else positive("--seq", args.seq, 4096),
        "search": "seq" if auto else "batch",
        "capacity_factor": factor,
        "optimizer": getattr(args, "optimizer", None),
        "device_type": getattr(args, "device_type", "cuda"),
        "reserve": parse_size(args.reserve) if args.reserve else None,
    }


def workload_peak(compiled, model_or_walk, train, workload: dict, device_memory, path: str):
    """The peak per rank (planc.compiler.peak_memory) on the config of the model (or its ModelWalk) explain resolved
    against; a sequence past the model's `max_position_embeddings` is a warning on stderr."""
    from planc.compiler.peak_memory import DEFAULT_RESERVE, peak_memory
    from planc.compiler.walk import ModelWalk, walk_model

    walk = model_or_walk if isinstance(model_or_walk, ModelWalk) else walk_model(model_or_walk)
    config = walk.config.to_dict()
    limit = config.get("max_position_embeddings")
    if limit and workload["seq"] > limit:
        sys.stderr.write(f"planc explain: {path}: warning: --seq {workload['seq']} is beyond the model's "
                         f"max_position_embeddings {limit}\n")
    peak = peak_memory(
        compiled, walk, config, train, workload=workload["workload"], batch=workload["batch"],
        seq=workload["seq"], capacity_factor=workload["capacity_factor"], device_memory=device_memory,
        optimizer=workload.get("optimizer"), device_type=workload.get("device_type", "cuda"),
        capability=workload.get("capability"),
        reserve=workload["reserve"] if workload["reserve"] is not None else DEFAULT_RESERVE,
        search=workload["search"],
    )
    if peak.fits is False:
        from planc.compiler.memory_hints import Situation, peak_hint

        # what no batch or sequence changes: parameters, plus gradients and AdamW state when training
        static = train.total if workload["workload"] == "train" and train is not None else compiled.bytes_per_rank
        situation = Situation(compiled, workload["workload"], static=static, room=device_memory - peak.reserve,
                              batch=workload["batch"], train_flag=workload["workload"] == "train",
                              moment=peak.moment, adamw_step=peak.adamw_step)
        sys.stderr.write(
            f"planc explain: {path}: PLC660 the peak per rank, {peak.peak / 2**30:.2f} GiB at {peak.moment}, plus the "
            f"{peak.reserve / 2**30:.1f} GiB reserve does not fit in {device_memory / 2**30:.1f} GiB of device memory"
            f"\n      hint: {peak_hint(situation, peak.max_batch, peak.max_seq)}\n")
    return peak


def _budget_json(b) -> dict:
    return {
        "hold_per_rank": dict(b.hold),
        "read_per_rank": dict(b.read) if b.read is not None else None,
        "device_memory": b.device_memory,
        "device_memory_read": b.device_read,
    }


def check_checkpoint(directory: str, plan_path: str, loaded, dtype: str, compiled, trust_code: bool = False):
    """(exit status, bytes each rank reads by checkpoint dtype or None): every check planc.load runs before reading
    (`planc.checkpoint.load.check_checkpoint`, the same function), and for a planc.save checkpoint what
    planc.load_optimizer would refuse of its optimizer state; the problems on stderr."""
    from planc.compiler.memory import read_per_rank
    from planc.checkpoint.keys import target_reads
    from planc.checkpoint.load import check_checkpoint as load_checks

    checked = load_checks(directory, loaded, dtype=None if dtype == "config" else dtype, launched=False,
                          trust_checkpoint_code=trust_code)
    try:
        if checked.problems:
            sys.stderr.write(
                f"planc explain: planc.load would refuse {directory} with {plan_path} "
                f"({len(checked.problems)} problem(s); nothing is read):\n"
                + "".join(f"  - {p}\n" for p in checked.problems)
            )
            return 1, None
        if checked.files is None:  # a planc.save checkpoint: DCP reads each rank's overlap, not a fixed byte count
            from planc.checkpoint.optimizer import optimizer_problems

            problems = optimizer_problems(directory, trust_checkpoint_code=trust_code)
            if problems:
                sys.stderr.write(f"planc explain: planc.load_optimizer would refuse {directory}:\n"
                                 + "".join(f"  - {p}\n" for p in problems))
                return 1, None
            return 0, None
        assert checked.model is not None  # no problems: the meta model was built
        return 0, read_per_rank(compiled, target_reads(checked.model, checked.files))
    finally:
        checked.close()


def explain_one(path: str, config: dict, overrides: dict, dtype: str, parallel=None):
    """(exit status, CompiledPlan or None, the walk of the meta model it resolved against or None) for one plan file;
    the problems go to stderr. `--train` and the peak count on that same walk rather than building it again."""
    rc, loaded = load_one(path, parallel)
    if loaded is None:
        return rc, None, None
    return compile_one(path, loaded, config, overrides, dtype)


def load_one(path: str, parallel=None):
    """(exit status, LoadedPlan or None): the plan file loaded once, at `--parallel`'s sizes; problems on stderr."""
    from planc.errors import PlanError
    from planc.lint.plan_loader import load_plan
    from planc.lint.rules_source import UNREADABLE_CODES

    try:
        return 0, load_plan(path, parallel=parallel)
    except PlanError as e:
        if any(d.code in UNREADABLE_CODES for d in e.diagnostics):  # like `planc lint`: unreadable input is 2
            sys.stderr.write(f"planc explain: cannot read {path}:\n{e}\n")
            return 2, None
        sys.stderr.write(f"planc explain: {path} does not lint clean:\n{e}\n")
        return 1, None
    except (OSError, TypeError) as e:
        sys.stderr.write(f"planc explain: cannot read {path}: {e}\n")
        return 2, None


def compile_one(path: str, loaded, config: dict, overrides: dict, dtype: str):
    """(exit status, CompiledPlan or None, the walk of the meta model it resolved against or None) for a loaded plan;
    the walk is read from data when one is stored for this model and config (planc.models.walk_cache)."""
    from planc.compiler.resolve import compile_plan
    from planc.errors import CompileError, ModelBuildError
    from planc.models.walk_cache import explain_walk

    model_type = config.get("model_type") or loaded.plan.model.type
    try:
        walk = explain_walk(model_type, {**config, **overrides}, dtype, overrides)
    except ModelBuildError as e:  # one line that names the model type (planc.models.build)
        sys.stderr.write(f"planc explain: {e}\n")
        return 2, None, None
    except (ValueError, TypeError, AttributeError) as e:  # a --dtype the config names that torch does not have
        sys.stderr.write(f"planc explain: cannot build a `{model_type}` model: {e}\n")
        return 2, None, None
    try:
        compiled = compile_plan(walk, loaded)
    except CompileError as e:
        sys.stderr.write(f"planc explain: {path} does not resolve against {walk.model_class}:\n{e}\n")
        return 1, None, None
    return 0, compiled, walk
