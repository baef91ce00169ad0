"""`planc lsp`: the language server (planc.lint.lsp) over stdin/stdout, for editors (docs/editors.md).

Needs the `planc[lsp]` extra (pygls); without it planc.cli says what to install and exits 2.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stdio", action="store_true", help="talk LSP over stdin/stdout (the default and only mode)")


def run(args: argparse.Namespace) -> int:
    from planc.lint.lsp import serve

    serve()
    return 0
