"""`planc lint [PATH ...]`: schema and semantic checks of plan files, for people, CI and pre-commit.

Exit status: 0 no errors, 1 errors (or warnings with --strict), 2 usage errors or input that could
not be read as text (missing path, not UTF-8, over 1 MiB). Importing this module is cheap: the
linter is imported in run().
"""

from __future__ import annotations

import argparse

DEFAULT_PATHS = ["plans/"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="*", metavar="PATH", help="plan files or directories (default: plans/)")
    parser.add_argument("--format", choices=("text", "json", "github"), default="text", help="output format")
    parser.add_argument("--strict", action="store_true", help="treat warnings as errors")


def run(args: argparse.Namespace) -> int:
    import sys

    from planc.lint.report import counts, render
    from planc.lint.rules_source import UNREADABLE_CODES
    from planc.lint.runner import check_paths

    from planc.lint.rules_source import NO_PLANS
    from planc.spec.source import UNREADABLE

    paths = args.paths or DEFAULT_PATHS
    files, diags = check_paths(paths, strict=args.strict)
    # missing paths and directories without plans are diagnostics, not files: counted apart in the summary
    no_plans = len({d.path for d in diags if d.code == NO_PLANS or (d.code == UNREADABLE and d.path not in files)})
    sys.stdout.write(render(diags, args.format, len(files), no_plans))
    errors, _warnings = counts(diags)
    if any(d.code in UNREADABLE_CODES for d in diags):
        return 2
    return 1 if errors else 0
