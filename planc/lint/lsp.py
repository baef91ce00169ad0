"""`planc lsp`: a language server that publishes every planc diagnostic as the plan is edited.

Built on pygls (the `planc[lsp]` extra): on every open and change it lints the editor's text (not the
file on disk) with the same pipeline as `planc lint`, and publishes each Diagnostic over the range of
the offending node, its hint in the message and in `data`. Problems found in a parent plan through
`extends:` are shown on the `extends:` value of the plan being edited, naming the parent's line (and
linking it as related information). Quick fixes: a did-you-mean the rule was sure of (`Diagnostic.fix`),
and `planc migrate`'s rewrite for removed styles (PLC320). Lint only: nothing here imports torch.

The editor side (yaml-language-server with the plan schema, or any LSP client) is in docs/editors.md.
"""

from __future__ import annotations

import os
from typing import Optional

from lsprotocol import types
from pygls.lsp.server import LanguageServer
from pygls.uris import from_fs_path, to_fs_path

from planc.lint.diagnostic import WARNING, Diagnostic
from planc.lint.runner import CheckResult, check_doc, from_source_error, internal_error
from planc.lint.rules_removed import REMOVED_STYLE
from planc.spec.source import SourceDoc, SourceError, parse_yaml, read_text
from planc.version import __version__

SOURCE = "planc"
MIGRATE_TITLE = "planc migrate: rewrite the removed styles"


def uri_path(uri: str) -> Optional[str]:
    """The file path of a `file:` URI (None for an unsaved, untitled buffer)."""
    return to_fs_path(uri) if uri.startswith("file:") else None


def _lines_of(path: str) -> list[str]:
    try:
        return read_text(path).splitlines()
    except SourceError:
        return []


def lint_buffer(text: str, path: Optional[str]) -> tuple[list[Diagnostic], Optional[SourceDoc]]:
    """(diagnostics, the parsed SourceDoc or None) of a buffer: `planc lint --stdin-filename path` exactly."""
    try:
        try:
            doc = parse_yaml(text, path)
        except SourceError as e:
            return [from_source_error(e)], None
        result: CheckResult = check_doc(doc)
        return result.diagnostics, doc
    except Exception as exc:  # noqa: BLE001 - as `planc lint`: a bug is a diagnostic, never a dead server
        return [internal_error(exc, path)], None


def _utf16(line: str, col: int) -> int:
    """LSP characters are UTF-16 code units; YAML columns are code points."""
    head = line[: max(col, 0)]
    return len(head.encode("utf-16-le")) // 2


def _range(lines: list[str], line: int, col: int, end: tuple[int, int]) -> types.Range:
    """The 0-based LSP range of a node from 1-based start and end; a point (a YAML syntax error) is widened to
    the word it stands on, so that there is something to underline."""
    sl, sc = line - 1, col - 1
    el, ec = end[0] - 1, end[1] - 1
    text = lines[sl] if 0 <= sl < len(lines) else ""
    if (el, ec) <= (sl, sc):
        el, ec = sl, sc
        while ec < len(text) and not text[ec].isspace():
            ec += 1
        if ec == sc:
            ec = min(sc + 1, len(text)) if text else sc
    end_text = lines[el] if 0 <= el < len(lines) else ""
    return types.Range(types.Position(sl, _utf16(text, sc)), types.Position(el, _utf16(end_text, ec)))


def to_lsp(diags: list[Diagnostic], text: str, path: Optional[str], doc: Optional[SourceDoc]
           ) -> list[types.Diagnostic]:
    """LSP diagnostics of one buffer; those located in another file (a parent plan) go on its `extends:` value."""
    lines = text.splitlines()
    extends_at = doc.value_position(("extends",)) if doc is not None else None
    out = []
    for d in diags:
        message = f"{d.message}\nhint: {d.hint}" if d.hint else d.message
        if d.module:
            message += f"\nmodule: {d.module}"
        related = None
        here = d.path == path or d.position is None
        if here:
            rng = _range(lines, d.line, d.col, d.end)
        else:
            at = extends_at
            rng = _range(lines, at.line, at.col, (at.end_line or at.line, at.end_col or at.col)) if at else \
                _range(lines, 1, 1, (1, 1))
            message = f"in {d.where} (through `extends`): {message}"
            if d.path and os.path.isabs(d.path):
                related = [types.DiagnosticRelatedInformation(
                    types.Location(from_fs_path(d.path), _range(_lines_of(d.path), d.line, d.col, d.end)),
                    f"{d.code} {d.severity}: {d.message}")]
        out.append(types.Diagnostic(
            range=rng,
            message=message,
            severity=types.DiagnosticSeverity.Warning if d.severity == WARNING else types.DiagnosticSeverity.Error,
            code=d.code,
            source=SOURCE,
            related_information=related,
            data={"hint": d.hint, "fix": d.fix if here else None, "line": d.line, "path": d.path},
        ))
    return out


def code_actions(
    text: str, path: Optional[str], uri: str, diagnostics: list[types.Diagnostic]
) -> list[types.CodeAction]:
    """Quick fixes for the diagnostics the client sends back: each sure did-you-mean, and one migrate rewrite."""
    actions = []
    for d in diagnostics:
        fix = (d.data or {}).get("fix") if isinstance(d.data, dict) else None
        if d.source == SOURCE and fix:
            actions.append(types.CodeAction(
                title=f"Replace with `{fix}`", kind=types.CodeActionKind.QuickFix, diagnostics=[d], is_preferred=True,
                edit=types.WorkspaceEdit(changes={uri: [types.TextEdit(d.range, fix)]}),
            ))
    removed = [d for d in diagnostics if d.source == SOURCE and d.code == REMOVED_STYLE]
    if removed:
        from planc.spec.migrate import MigrateError, migrate_text

        try:
            migration = migrate_text(text, path)
        except (MigrateError, SourceError):
            migration = None
        if migration is not None and migration.changed:
            lines = text.splitlines(keepends=True)
            whole = types.Range(types.Position(0, 0), types.Position(len(lines), 0))
            actions.append(types.CodeAction(
                title=MIGRATE_TITLE, kind=types.CodeActionKind.QuickFix, diagnostics=removed, is_preferred=True,
                edit=types.WorkspaceEdit(changes={uri: [types.TextEdit(whole, migration.text)]}),
            ))
    return actions


def build_server() -> LanguageServer:
    server = LanguageServer("planc", __version__)

    def publish(uri: str) -> None:
        document = server.workspace.get_text_document(uri)
        path = uri_path(uri)
        diags, doc = lint_buffer(document.source, path)
        server.text_document_publish_diagnostics(types.PublishDiagnosticsParams(
            uri=uri, version=document.version, diagnostics=to_lsp(diags, document.source, path, doc)))

    def relint(uri: str) -> None:
        publish(uri)
        # plans that extend the one just edited see its saved text: lint them again too
        for other in list(server.workspace.text_documents):
            if other != uri and "extends" in server.workspace.get_text_document(other).source:
                publish(other)

    @server.feature(types.INITIALIZED)
    def initialized(ls: LanguageServer, params: types.InitializedParams) -> None:
        # the linter imports its rules and the plan models on first use: pay that now, not on the first open
        lint_buffer("version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 1}\n", None)

    @server.feature(types.TEXT_DOCUMENT_DID_OPEN)
    def did_open(ls: LanguageServer, params: types.DidOpenTextDocumentParams) -> None:
        publish(params.text_document.uri)

    @server.feature(types.TEXT_DOCUMENT_DID_CHANGE)
    def did_change(ls: LanguageServer, params: types.DidChangeTextDocumentParams) -> None:
        publish(params.text_document.uri)

    @server.feature(types.TEXT_DOCUMENT_DID_SAVE)
    def did_save(ls: LanguageServer, params: types.DidSaveTextDocumentParams) -> None:
        relint(params.text_document.uri)

    @server.feature(types.TEXT_DOCUMENT_DID_CLOSE)
    def did_close(ls: LanguageServer, params: types.DidCloseTextDocumentParams) -> None:
        ls.text_document_publish_diagnostics(types.PublishDiagnosticsParams(uri=params.text_document.uri,
                                                                            diagnostics=[]))

    @server.feature(types.TEXT_DOCUMENT_CODE_ACTION,
                    types.CodeActionOptions(code_action_kinds=[types.CodeActionKind.QuickFix]))
    def code_action(ls: LanguageServer, params: types.CodeActionParams) -> list[types.CodeAction]:
        uri = params.text_document.uri
        document = ls.workspace.get_text_document(uri)
        return code_actions(document.source, uri_path(uri), uri, list(params.context.diagnostics))

    return server


def serve() -> None:
    """Serve over stdin/stdout until the client says exit."""
    build_server().start_io()
