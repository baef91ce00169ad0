"""`planc verify PLAN`: run the plan at its own sizes on CPU gloo ranks against the unsharded model, stage by stage.

Exit 0: certified (every stage within its tolerance); 1: mismatch (the first divergence is named, with the plan
rule that sharded it); 2: could not run (the reason). The engine is `planc.verify` (planc/verification/).
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN", help="plan file (YAML)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="DIR", help="a local checkpoint or config directory (its config.json; "
                        "weights are not read: verify compares random weights)")
    source.add_argument("--model-type", metavar="T", help="a transformers model type: its default config "
                        "(default: the plan's model.type)")
    source.add_argument("--build", metavar="PKG.MOD:FN", help="a function returning a fresh, seeded nn.Module: "
                        "the way to verify custom modeling code")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="with --model: run the modeling code the directory ships")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value (YAML scalar); repeatable")
    parser.add_argument("--parallel", metavar="SIZES", help="verify at other sizes, e.g. --parallel tp_size=2,ep_size=2")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of both models (tolerances follow it)")
    parser.add_argument("--train", action="store_true",
                        help="the training stages (also on when the plan has a `training:` section)")
    parser.add_argument("--reshard", metavar="SIZES",
                        help="sizes the saved checkpoint is loaded back at (default: half of tp_size and ep_size), "
                        "e.g. --reshard tp_size=2,ep_size=4; `none`: no reshard stage")
    parser.add_argument("--no-shrink", action="store_true",
                        help="run the real widths with the fewest layers that hold one of each kind")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch")
    parser.add_argument("--memory", action="store_true",
                        help="also run rank 0 at full width under a fake process group (torch's MemTracker) and "
                        "flag `planc explain`'s predicted peak when it is over 5%% under the measured one")
    parser.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=None,
                        help="the Mega MoE kernel stages: the Triton backend against the reference backend at the "
                        "plan's real per-rank shapes (default: on a CUDA GPU when there is one, else reported as not "
                        "run; --kernels also runs them under Triton's CPU interpreter, TRITON_INTERPRET=1)")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format")


def run(args: argparse.Namespace) -> int:
    from planc.commands.explain import parse_overrides, parse_parallel

    try:
        overrides = parse_overrides(args.overrides)
        parallel = parse_parallel(args.parallel)
        reshard = {} if args.reshard == "none" else parse_parallel(args.reshard)
    except ValueError as e:
        print(f"planc verify: {e}", file=sys.stderr)
        return 2
    try:
        import torch  # noqa: F401 - only to say what is missing before anything starts
        import transformers  # noqa: F401
    except ImportError:
        print("planc verify: needs torch and transformers: pip install 'planc[runtime]'", file=sys.stderr)
        return 2
    from planc.verification import verify
    from planc.verification.engine import main_progress

    report = verify(args.build, args.plan, parallel=parallel, train=args.train, dtype=args.dtype, model=args.model,
                    model_type=args.model_type, trust_remote_code=args.trust_remote_code, overrides=overrides,
                    shrink=not args.no_shrink, reshard=reshard, seed=args.seed, progress=main_progress(),
                    memory=args.memory, kernels=args.kernels)
    if args.format == "json":
        print(report.render_json())
    else:
        text = report.render_text()
        print(text, end="", file=sys.stderr if report.error is not None else sys.stdout)
    return report.exit_code
