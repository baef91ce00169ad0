"""`planc` command line: one sub-command per module in planc/commands/, imported only when used.

Keeping the imports lazy keeps `planc lint` free of torch and fast enough for a pre-commit hook.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "lint": "Validate plan files (schema + semantic rules).",
    "rules": "List the lint rules, or explain one: planc rules CODE.",
    "schema": "Print the JSON Schema of plan format v1.",
    "explain": "Resolve a plan against a model built on the meta device and print what it does.",
    "migrate": "Rewrite removed styles in a plan into their current form.",
    "init": "Write a starting plan from transformers' own plans for a model type.",
    "lsp": "Language server: every planc diagnostic in the editor as you type (needs planc[lsp]).",
    "demo": "Apply a shipped plan on CPU ranks to a tiny model and compare with the unsharded model.",
    "verify": "Prove on CPU ranks, at the plan's own sizes, that the sharded run equals the unsharded model.",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """All commands are listed; only `only`'s module is imported, so one command cannot break another."""
    from planc.version import __version__

    parser = argparse.ArgumentParser(prog="planc", description="Declarative TP/EP plans for MoE models.")
    parser.add_argument("--version", action="version", version=f"planc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=f"planc.commands.{name}")
        if name == only:
            importlib.import_module(f"planc.commands.{name}").add_arguments(p)
    return parser


def _subparsers(parser: argparse.ArgumentParser) -> dict:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # reported by the sub-command's parser, so the usage shown is that command's
            command_parser = _subparsers(parser).get(getattr(args, "command", None) or "", parser)
            command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # argparse exits 2 on usage errors, 0 on --help / --version
        return int(e.code or 0)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
