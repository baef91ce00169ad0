"""`planc lint [PATH ...]`: schema and semantic checks of plan files, for people, CI and pre-commit.

`planc lint --stdin-filename PATH` (or `planc lint -`) lints the text on standard input instead: an
editor's unsaved buffer. PATH names it in the diagnostics and anchors a relative `extends:`; the file
itself is not read.

Exit status: 0 no errors, 1 errors (or warnings with --strict), 2 usage errors or input that could
not be read as text (missing path, not UTF-8, over 1 MiB). Importing this module is cheap: the
linter is imported in run().
"""

from __future__ import annotations

import argparse

DEFAULT_PATHS = ["plans/"]


def default_paths() -> list[str]:
    """`plans/` of the current directory (a checkout, a project with plans), else the plans planc ships."""
    import os

    from planc.spec.shipped import PLANS_DIR

    return DEFAULT_PATHS if os.path.isdir(DEFAULT_PATHS[0]) else [str(PLANS_DIR)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="*", metavar="PATH", help="plan files or directories (default: plans/, else the shipped plans)")
    parser.add_argument("--format", choices=("text", "json", "github"), default="text", help="output format")
    parser.add_argument("--strict", action="store_true", help="treat warnings as errors")
    parser.add_argument("--quiet", action="store_true",
                        help="print nothing when there is no problem (pre-commit: only failing plans are shown)")
    parser.add_argument(
        "--stdin-filename", metavar="PATH",
        help="lint the plan read from standard input; PATH names it and anchors a relative `extends:`",
    )


def run(args: argparse.Namespace) -> int:
    import sys

    from planc.lint.report import counts, render
    from planc.lint.rules_source import UNREADABLE_CODES
    from planc.lint.runner import check_paths

    from planc.lint.rules_source import NO_PLANS
    from planc.spec.source import UNREADABLE

    if args.stdin_filename is not None or args.paths == ["-"]:
        if args.paths not in ([], ["-"]):
            sys.stderr.write("planc lint: --stdin-filename lints standard input; give no PATH besides `-`\n")
            return 2
        files, diags = _check_stdin(args.stdin_filename or "<stdin>", args.strict)
    else:
        files, diags = check_paths(args.paths or default_paths(), strict=args.strict)
    # missing paths and directories without plans are diagnostics, not files: counted apart in the summary
    no_plans = len({d.path for d in diags if d.code == NO_PLANS or (d.code == UNREADABLE and d.path not in files)})
    if diags or not args.quiet:
        sys.stdout.write(render(diags, args.format, len(files), no_plans))
    errors, _warnings = counts(diags)
    if any(d.code in UNREADABLE_CODES for d in diags):
        return 2
    return 1 if errors else 0


def _check_stdin(path, strict: bool):
    """([path], diagnostics) of the plan on standard input, read with the same size and encoding checks as a file."""
    import dataclasses
    import sys

    from planc.lint.diagnostic import ERROR
    from planc.lint.runner import check_text, from_source_error
    from planc.spec.source import MAX_PLAN_BYTES, TOO_LARGE, Position, SourceError, decode

    raw = sys.stdin.buffer.read(MAX_PLAN_BYTES + 1)
    try:
        if len(raw) > MAX_PLAN_BYTES:
            raise SourceError(TOO_LARGE, f"plan text is larger than {MAX_PLAN_BYTES // (1 << 20)} MiB",
                              "a plan is a few dozen lines", Position(path, 1, 1))
        diags = check_text(decode(raw, path), path).diagnostics
    except SourceError as e:
        diags = [from_source_error(e)]
    if strict:
        diags = [dataclasses.replace(d, severity=ERROR) for d in diags]
    return [path], diags
