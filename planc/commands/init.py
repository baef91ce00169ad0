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
    from planc.errors import ModelBuildError, one_line
    from planc.models.build import check_override_keys
    from planc.models.synthesis import init_plan

    if args.output:
        try:
            check_target(args.output, overwrite=args.force)  # before the minute of building and compiling
        except OutputError as e:
            sys.stderr.write(f"planc init: {e}\n")
            return 2
    try:
        overrides = parse_overrides(args.overrides)
        check_override_keys(args.model_type, overrides)
        config = read_config(args.config) if args.config else {}
        text = init_plan(args.model_type, config, overrides)
    except ModelBuildError as e:
        if "cannot build" in str(e):  # transformers rejected the config: say what to pass
            sys.stderr.write(f"planc init: {one_line(e)}\n    hint: {_build_hint(args, e)}\n")
        else:  # an unknown type or a --set key the config lacks: the message names the fix
            sys.stderr.write(f"planc init: {one_line(e)}\n")
        return 2
    except (OSError, ValueError, KeyError) as e:
        sys.stderr.write(f"planc init: {e}\n")
        return 2
    except Exception as e:  # noqa: BLE001 - a config transformers cannot build: one line, not a traceback
        sys.stderr.write(f"planc init: {type(e).__name__}: {one_line(e)}\n    hint: {_build_hint(args, e)}\n")
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


def _build_hint(args: argparse.Namespace, error: BaseException) -> str:
    """What to pass when transformers cannot build the model: the model's own config.json, or the values its
    default config leaves unset (named, with the `--set` spelling)."""
    if args.config or args.overrides:
        return "check the values given with --config/--set against the model's own config.json"
    from planc.models.build import config_gaps

    gaps = config_gaps(args.model_type, error)
    if gaps and " (read from " in gaps[0]:  # a value the config class has no field for: --set cannot give it
        inner = gaps[0].split(" (", 1)[1][:-1].replace("read ", "", 1)
        named = f"; the model reads `{gaps[0].split()[0]}` {inner}: only --config can give it"
    elif gaps:
        example = " ".join(f"--set {k}=..." for k in gaps[:3])
        named = (f"; its default config leaves {', '.join(f'`{k}`' for k in gaps)} unset (None); set values with "
                 f"`--set KEY=VALUE`, e.g. `planc init --from-transformers {args.model_type} {example}`")
    else:
        named = ""
    return (f"transformers' default `{args.model_type}` config does not describe a buildable model. Pass the model's "
            f"own config: `planc init --from-transformers {args.model_type} --config path/to/config.json` (the "
            f"config.json of its checkpoint){named}")
