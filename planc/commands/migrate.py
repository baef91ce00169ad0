"""`planc migrate PLAN [--write]`: rewrite removed styles into the current form (see planc.spec.migrate).

Without `--write` it prints a unified diff and changes nothing. The result is linted before it is
shown or written: a migration that would not lint clean is refused (exit 1) with the diagnostics.
Exit status: 0 migrated or nothing to do, 1 the result does not lint clean, 2 unreadable input or a
plan the line editor cannot rewrite.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN", help="plan file (YAML) to migrate")
    parser.add_argument("--write", action="store_true", help="rewrite the file in place instead of printing a diff")


def run(args: argparse.Namespace) -> int:
    from planc.lint.runner import lint_text
    from planc.spec.migrate import MigrateError, migrate_text
    from planc.spec.source import SourceError, read_text

    try:
        text = read_text(args.plan)
        migration = migrate_text(text, args.plan)
    except (SourceError, MigrateError) as e:
        sys.stderr.write(f"planc migrate: {args.plan}: {e}\n")
        return 2
    if not migration.changed:
        sys.stdout.write(f"{args.plan}: nothing to migrate\n")
        return 0
    errors = [d for d in lint_text(migration.text, args.plan) if d.severity == "error"]
    if errors:
        sys.stderr.write(
            f"planc migrate: the migrated {args.plan} would not lint clean; fix these by hand, then run migrate again:\n"
            + "\n".join(d.format() for d in errors)
            + "\n"
        )
        sys.stdout.write(migration.diff(args.plan))
        return 1
    if args.write:
        with open(args.plan, "w", encoding="utf-8", newline="") as f:
            f.write(migration.text)
        sys.stdout.write("".join(f"{args.plan}: {c}\n" for c in migration.changes))
    else:
        sys.stdout.write(migration.diff(args.plan))
    return 0
