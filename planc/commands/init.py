"""`planc init --from-transformers MODEL_TYPE [-o FILE]`: a starting plan from transformers' own plans.

transformers keeps its plans on the config class (`base_model_tp_plan`, `base_model_ep_plan`, keys
relative to the base model) and on the model class (`_tp_plan`, e.g. `lm_head`). This writes them as a
planc plan with the prefix the `*ForCausalLM` class needs (`model.`), applies the two things
transformers does implicitly (the vocab-parallel embedding it adds to every TP plan, and dropping TP
rules on experts that the EP plan shards), and comments out what would not compile against the
default config: rules that match nothing there and styles planc's runtime does not install. The
sizes are the largest of 8, 4, 2 under which the plan compiles against the full-size default model
on the meta device, so the output lints clean and compiles as written.
"""

from __future__ import annotations

import argparse
import sys

SIZES = (8, 4, 2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--from-transformers", dest="model_type", metavar="MODEL_TYPE", required=True,
        help="transformers `config.model_type`, e.g. mixtral",
    )
    parser.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    parser.add_argument("--force", action="store_true", help="overwrite FILE if it exists")


def _transformers_plans(model_type: str):
    """(tp rules, ep rules, lm-head rules, prefix, model class, config) exactly as transformers declares them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type)
    model_cls = AutoModelForCausalLM._model_mapping[type(config)]
    prefix = getattr(model_cls, "base_model_prefix", "model") or "model"
    tp = dict(type(config).base_model_tp_plan or {})
    ep = dict(type(config).base_model_ep_plan or {})
    head = dict(getattr(model_cls, "_tp_plan", None) or {})
    return tp, ep, head, prefix, model_cls, config


def _under(pattern: str, ep_keys) -> bool:
    return any(pattern == k or pattern.startswith(k + ".") for k in ep_keys)


def init_plan(model_type: str) -> str:
    """The plan text for `model_type` (raises ValueError for unknown types)."""
    import transformers

    from planc.compiler.resolve import compile_plan
    from planc.compiler.walk import walk_model
    from planc.errors import CompileError
    from planc.runtime.models import build_meta_model
    from planc.spec.patterns import Pattern
    from planc.spec.styles import RUNTIME_STYLES

    tp_base, ep_base, head, prefix, model_cls, config = _transformers_plans(model_type)
    config_cls = type(config).__name__
    model = build_meta_model(model_type)
    generic = list(walk_model(model).by_generic)
    notes: list[str] = []
    tp: dict[str, str] = {}
    ep: dict[str, str] = {}
    if tp_base:  # transformers adds the vocab-parallel embedding to every TP plan
        tp[f"{prefix}.embed_tokens"] = "embedding_rowwise"
    tp.update({f"{prefix}.{k}": v for k, v in tp_base.items()})
    tp.update(head)
    ep.update({f"{prefix}.{k}": v for k, v in ep_base.items()})
    ep_experts = [k for k, s in ep.items() if s == "ep_dispatch_experts"]

    def keep(table: str, pattern: str, style: str) -> bool:
        if not any(Pattern(pattern).matches(g) for g in generic):
            notes.append(f"{table} `{pattern}: {style}`: matches nothing in the default {model_type} config")
            return False
        if style not in RUNTIME_STYLES:
            notes.append(f"{table} `{pattern}: {style}`: planc's runtime does not install `{style}`")
            return False
        if table == "tp_plan" and _under(pattern, ep_experts):
            notes.append(f"tp_plan `{pattern}: {style}`: the experts are expert-parallel (ep_plan), EP wins")
            return False
        return True

    tp = {k: v for k, v in tp.items() if keep("tp_plan", k, v)}
    ep = {k: v for k, v in ep.items() if keep("ep_plan", k, v)}
    for size in SIZES:
        text = _render(model_type, config_cls, model_cls.__name__, transformers.__version__, size, tp, ep, notes)
        try:
            compile_plan(model, text)
        except CompileError:
            continue
        return text
    raise ValueError(
        f"transformers' plans for `{model_type}` do not compile at tp_size 8, 4 or 2 against the default config; "
        "run `planc explain` on the output of a smaller edit to see why"
    )


def _render(model_type, config_cls, model_cls, version, size, tp, ep, notes) -> str:
    lines = [
        f"# Starting plan for {model_type}, written by `planc init --from-transformers {model_type}`",
        f"# from transformers {version}: {config_cls}.base_model_tp_plan / base_model_ep_plan (prefixed",
        f"# `model.` for {model_cls}) and {model_cls}._tp_plan. Edit sizes and rules, then run",
        "# `planc lint` and `planc explain` on it.",
    ]
    if notes:
        lines.append("# Left out of transformers' plans:")
        lines.extend(f"#   {n}" for n in notes)
    lines += [
        "version: 1",
        f"name: {model_type.replace('_', '-')}-tp{size}" + (f"-ep{size}" if ep else ""),
        "model:",
        f"  type: {model_type}",
        "parallel:",
        f"  tp_size: {size}",
    ]
    if ep:
        lines += [f"  ep_size: {size}", "experts:", "  implementation: grouped_mm", "  ep_implementation: auto"]
    for table, rules in (("tp_plan", tp), ("ep_plan", ep)):
        if rules:
            lines.append(f"{table}:")
            lines.extend(f"  {k}: {v}" for k, v in rules.items())
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    from planc.commands.files import OutputError, check_target, write_file

    if args.output:
        try:
            check_target(args.output, overwrite=args.force)  # before the minute of building and compiling
        except OutputError as e:
            sys.stderr.write(f"planc init: {e}\n")
            return 2
    try:
        text = init_plan(args.model_type)
    except (ValueError, KeyError) as e:
        sys.stderr.write(f"planc init: {e}\n")
        return 2
    if args.output:
        try:
            write_file(args.output, text.encode("utf-8"), overwrite=args.force)
        except OutputError as e:
            sys.stderr.write(f"planc init: {e}\n")
            return 2
    else:
        sys.stdout.write(text)
    return 0
