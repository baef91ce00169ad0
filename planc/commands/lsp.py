"""`planc lsp`: the language server (planc.lint.lsp) over stdin/stdout, for editors (docs/editors.md).

Needs the `planc[lsp]` extra (pygls); without it the command says what to install and exits 2.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stdio", action="store_true", help="talk LSP over stdin/stdout (the default and only mode)")


def run(args: argparse.Namespace) -> int:
    import sys

    try:
        from planc.lint.lsp import serve
    except ImportError as e:
        sys.stderr.write(f"planc lsp: needs pygls ({e}); install it with `pip install 'planc[lsp]'`\n")
        return 2
    serve()
    return 0
