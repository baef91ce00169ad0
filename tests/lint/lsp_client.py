"""A small editor for the LSP tests: pygls' LanguageClient driving a real server process over stdio.

`Editor` runs the client's event loop in a thread, so that synchronous tests can open documents, change
them, and wait for the diagnostics the server publishes (each document its own URI), or ask for
completion, hover and code actions. It answers the requests a server sends its client
(`workspace/configuration`: yaml-language-server asks for its settings there).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Optional

from lsprotocol import types
from pygls.lsp.client import LanguageClient

from .helpers import REPO

YLS_VERSION = "2.0.0"  # .ci/run installs this one into .ci/node
# yaml-language-server's settings, as the Red Hat YAML extension sends them
YAML_SETTINGS = {"validate": True, "hover": True, "completion": True, "format": {"enable": False},
                 "schemaStore": {"enable": False}, "schemas": {}}


def yaml_language_server() -> Optional[list[str]]:
    """The command of the yaml-language-server .ci/run installs (or one on PATH); None when there is no node."""
    node = shutil.which("node")
    if node is None:
        return None
    for root in (os.environ.get("PLANC_YLS_PREFIX"), str(REPO / ".ci" / "node")):
        if root:
            script = Path(root) / "node_modules" / "yaml-language-server" / "bin" / "yaml-language-server"
            if script.exists():
                return [node, str(script), "--stdio"]
    found = shutil.which("yaml-language-server")
    return [found, "--stdio"] if found else None


class Editor:
    """One server process and the client that talks to it; use as a context manager."""

    def __init__(self, command: list[str], root: Path, env: Optional[dict] = None):
        self.command, self.root, self.env = command, root, env
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.published: dict[str, list[tuple[float, Optional[int], list]]] = {}
        self.changed = threading.Condition()
        self.client = LanguageClient("planc-tests", "1")
        self.version: dict[str, int] = {}

        @self.client.feature(types.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)
        def on_diagnostics(params: types.PublishDiagnosticsParams):
            with self.changed:
                self.published.setdefault(params.uri, []).append(
                    (time.perf_counter(), params.version, params.diagnostics))
                self.changed.notify_all()

        @self.client.feature(types.WORKSPACE_CONFIGURATION)
        def on_configuration(params: types.ConfigurationParams):
            return [YAML_SETTINGS if item.section == "yaml" else None for item in params.items]

        for method in (types.WINDOW_LOG_MESSAGE, types.WINDOW_SHOW_MESSAGE, types.CLIENT_REGISTER_CAPABILITY,
                       types.WINDOW_WORK_DONE_PROGRESS_CREATE, "$/progress", types.TELEMETRY_EVENT):
            self.client.feature(method)(lambda *a: None)

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> "Editor":
        self.thread.start()
        self.run(self.client.start_io(*self.command, env=self.env, cwd=str(self.root)))
        capabilities = types.ClientCapabilities(
            text_document=types.TextDocumentClientCapabilities(
                publish_diagnostics=types.PublishDiagnosticsClientCapabilities(related_information=True),
                completion=types.CompletionClientCapabilities(completion_item=types.ClientCompletionItemOptions(
                    documentation_format=[types.MarkupKind.Markdown, types.MarkupKind.PlainText])),
                hover=types.HoverClientCapabilities(content_format=[types.MarkupKind.Markdown]),
                code_action=types.CodeActionClientCapabilities(),
            ),
            workspace=types.WorkspaceClientCapabilities(configuration=True),
        )
        uri = self.root.as_uri()
        self.run(self.client.initialize_async(types.InitializeParams(
            capabilities=capabilities, root_uri=uri, process_id=os.getpid(),
            workspace_folders=[types.WorkspaceFolder(uri, "plans")])))
        self.client.initialized(types.InitializedParams())
        self.client.workspace_did_change_configuration(
            types.DidChangeConfigurationParams(settings={"yaml": YAML_SETTINGS}))
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.run(self.client.shutdown_async(None), timeout=10)
            self.client.exit(None)
            self.run(self.client.stop(), timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    def _send(self, fn, params) -> None:
        self.loop.call_soon_threadsafe(fn, params)

    def open(self, path: Path, text: str) -> str:
        """Open `text` as the buffer of `path` (the file need not exist); returns its URI."""
        uri = path.as_uri()
        self.version[uri] = 1
        self._send(self.client.text_document_did_open, types.DidOpenTextDocumentParams(
            types.TextDocumentItem(uri=uri, language_id="yaml", version=1, text=text)))
        return uri

    def change(self, uri: str, text: str) -> int:
        """Replace the whole buffer; returns the new version."""
        self.version[uri] += 1
        self._send(self.client.text_document_did_change, types.DidChangeTextDocumentParams(
            types.VersionedTextDocumentIdentifier(uri=uri, version=self.version[uri]),
            [types.TextDocumentContentChangeWholeDocument(text=text)]))
        return self.version[uri]

    def save(self, uri: str) -> None:
        self._send(self.client.text_document_did_save,
                   types.DidSaveTextDocumentParams(types.TextDocumentIdentifier(uri=uri)))

    def close(self, uri: str) -> None:
        self._send(self.client.text_document_did_close,
                   types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(uri=uri)))

    def diagnostics(self, uri: str, count: int = 1, timeout: float = 30, settle: float = 0.0) -> list:
        """The diagnostics of the `count`-th publication for `uri` (waiting for it); with `settle`, the last
        publication once none came for that many seconds (yaml-language-server may publish twice)."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while len(self.published.get(uri, [])) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no diagnostics published for {uri} within {timeout}s")
                self.changed.wait(left)
            while settle:
                n = len(self.published[uri])
                self.changed.wait(settle)
                if len(self.published[uri]) == n or time.monotonic() > deadline:
                    break
            return list(self.published[uri][-1][2] if settle else self.published[uri][count - 1][2])

    def completion(self, uri: str, line: int, character: int):
        return self.run(self.client.text_document_completion_async(types.CompletionParams(
            types.TextDocumentIdentifier(uri=uri), types.Position(line, character))))

    def hover(self, uri: str, line: int, character: int):
        return self.run(self.client.text_document_hover_async(types.HoverParams(
            types.TextDocumentIdentifier(uri=uri), types.Position(line, character))))

    def code_actions(self, uri: str, diagnostics: list):
        whole = types.Range(types.Position(0, 0), types.Position(10_000, 0))
        return self.run(self.client.text_document_code_action_async(types.CodeActionParams(
            types.TextDocumentIdentifier(uri=uri), whole, types.CodeActionContext(diagnostics=diagnostics))))


def apply_edits(text: str, edits: list) -> str:
    """`text` with LSP TextEdits applied (ranges over the original, applied from the last; ASCII text)."""
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(p: types.Position) -> int:
        return len(text) if p.line >= len(lines) else starts[p.line] + p.character

    for e in sorted(edits, key=lambda e: (e.range.start.line, e.range.start.character), reverse=True):
        text = text[: offset(e.range.start)] + e.new_text + text[offset(e.range.end):]
    return text
