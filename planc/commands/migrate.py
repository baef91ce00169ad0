"""`planc migrate PLAN [--write]`: rewrite removed styles into the current form (see planc.spec.migrate).

Without `--write` it prints a unified diff and changes nothing. The result is linted before it is
shown or written: a migration that would not lint clean is refused (exit 1) with the diagnostics.
Exit status: 0 migrated or nothing to do, 1 the result does not lint clean, 2 unreadable input, a
plan the line editor cannot rewrite, or a file that cannot be written (read-only file or directory,
full disk): `--write` replaces the plan atomically (planc.commands.files), so it is never left
half-written. A leading byte-order mark and every untouched byte are kept; a symlink is written
through to its target.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN", help="plan file (YAML) to migrate")
    parser.add_argument("--write", action="store_true", help="rewrite the file in place instead of printing a diff")


def run(args: argparse.Namespace) -> int:
    from planc.commands.files import OutputError, write_file
    from planc.lint.runner import lint_text
    from planc.spec.migrate import MigrateError, migrate_text
    from planc.spec.source import SourceError, decode, read_bytes

    try:
        raw = read_bytes(args.plan)
        migration = migrate_text(decode(raw, args.plan), args.plan)
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
        bom = b"\xef\xbb\xbf" if raw.startswith(b"\xef\xbb\xbf") else b""
        try:
            write_file(args.plan, bom + migration.text.encode("utf-8"), overwrite=True)
        except OutputError as e:
            sys.stderr.write(f"planc migrate: {e}\n")
            return 2
        sys.stdout.write("".join(f"{args.plan}: {c}\n" for c in migration.changes))
    else:
        sys.stdout.write(migration.diff(args.plan))
    return 0
