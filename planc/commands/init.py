"""`planc init --from-transformers MODEL_TYPE [--config config.json] [--set k=v ...] [-o FILE]`.

Arguments and output only: the plan comes from `planc.models.synthesis.init_plan` (what transformers
declares for the model type, resolved against the model built on the meta device, the closest plan
that compiles with every dropped rule a comment).
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--from-transformers", dest="model_type", metavar="MODEL_TYPE", required=True,
        help="transformers `config.model_type`, e.g. mixtral, qwen3_vl_moe",
    )
    parser.add_argument("--config", metavar="CONFIG_JSON", help="a model config.json instead of the default config")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value (YAML scalar; `text_config.x` for a sub-config); repeatable",
    )
    parser.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    parser.add_argument("--force", action="store_true", help="overwrite FILE if it exists")


def run(args: argparse.Namespace) -> int:
    from planc.commands.explain import parse_overrides, read_config
    from planc.commands.files import OutputError, check_target, write_file
    from planc.errors import one_line
    from planc.models.synthesis import init_plan

    if args.output:
        try:
            check_target(args.output, overwrite=args.force)  # before the minute of building and compiling
        except OutputError as e:
            sys.stderr.write(f"planc init: {e}\n")
            return 2
    try:
        overrides = parse_overrides(args.overrides)
        config = read_config(args.config) if args.config else {}
        text = init_plan(args.model_type, config, overrides)
    except (OSError, ValueError, KeyError) as e:
        sys.stderr.write(f"planc init: {e}\n")
        return 2
    except Exception as e:  # noqa: BLE001 - a config transformers cannot build: one line, not a traceback
        sys.stderr.write(
            f"planc init: cannot build a `{args.model_type}` model from "
            f"{'--config/--set' if args.config or args.overrides else 'transformers default config'}: "
            f"{type(e).__name__}: {one_line(e)}. Pass a real config with --config, or fix values with --set\n"
        )
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
