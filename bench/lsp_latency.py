"""Latency of `planc lsp`: from a keystroke (didChange) to its diagnostics (publishDiagnostics of that version).

The budget: the first diagnostics within 300 ms of a change on a shipped plan. One `planc lsp`
process (pygls' LanguageClient over stdio, as an editor runs it) gets every shipped plan opened; then each
plan is changed `--changes` times, alternating a one-character edit that breaks it (`version: 2`) and the
original text, and the time from sending the change to receiving the diagnostics of that version is
recorded. The peer, measured in the same run: the same buffers linted by `planc lint --stdin-filename`
in a fresh process each time (what an editor without a language server would run on every save).
Prints median, 95th percentile and maximum of each, and the ratio of the medians; and the same for each
plan's didOpen (the first open pays the linter's imports).

    .venv/bin/python bench/lsp_latency.py [--changes 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def broken(text: str) -> str:
    assert "\nversion: 1\n" in text
    return text.replace("\nversion: 1\n", "\nversion: 2\n", 1)


async def measure(plans: list[Path], changes: int) -> list[float]:
    from lsprotocol import types
    from pygls.lsp.client import LanguageClient

    client = LanguageClient("planc-bench", "1")
    arrived: dict[tuple[str, int], float] = {}
    waiting: dict[tuple[str, int], asyncio.Future] = {}

    @client.feature(types.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)
    def on_diagnostics(params: types.PublishDiagnosticsParams):
        key = (params.uri, params.version)
        arrived[key] = time.perf_counter()
        if key in waiting and not waiting[key].done():
            waiting[key].set_result(params.diagnostics)

    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    await client.start_io(sys.executable, "-m", "planc", "lsp", env=env, cwd=str(REPO))
    await client.initialize_async(types.InitializeParams(capabilities=types.ClientCapabilities(),
                                                         root_uri=REPO.as_uri()))
    client.initialized(types.InitializedParams())
    loop = asyncio.get_running_loop()
    times, opens = [], []
    for plan in plans:
        uri, text = plan.as_uri(), plan.read_text()
        waiting[(uri, 1)] = loop.create_future()
        sent = time.perf_counter()
        client.text_document_did_open(types.DidOpenTextDocumentParams(
            types.TextDocumentItem(uri=uri, language_id="yaml", version=1, text=text)))
        await asyncio.wait_for(waiting[(uri, 1)], 30)
        opens.append(arrived[(uri, 1)] - sent)
        for version in range(2, changes + 2):
            new = broken(text) if version % 2 == 0 else text
            waiting[(uri, version)] = loop.create_future()
            sent = time.perf_counter()
            client.text_document_did_change(types.DidChangeTextDocumentParams(
                types.VersionedTextDocumentIdentifier(uri=uri, version=version),
                [types.TextDocumentContentChangeWholeDocument(text=new)]))
            diagnostics = await asyncio.wait_for(waiting[(uri, version)], 30)
            times.append(arrived[(uri, version)] - sent)
            assert bool(diagnostics) == (version % 2 == 0), (plan, version, diagnostics)
    await client.shutdown_async(None)
    client.exit(None)
    await client.stop()
    return opens, times


def cli_times(plans: list[Path], runs: int) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    times = []
    for plan in plans:
        text = broken(plan.read_text())
        for _ in range(runs):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "planc", "lint", "--stdin-filename", str(plan)], input=text,
                           text=True, capture_output=True, env=env, cwd=REPO)
            times.append(time.perf_counter() - start)
    return times


def summary(times: list[float]) -> str:
    ordered = sorted(times)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return (f"median {statistics.median(times) * 1e3:7.1f} ms   p95 {p95 * 1e3:7.1f} ms   "
            f"max {max(times) * 1e3:7.1f} ms   ({len(times)} changes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--changes", type=int, default=20, help="changes per shipped plan")
    parser.add_argument("--cli-runs", type=int, default=3, help="planc lint processes per shipped plan (the peer)")
    args = parser.parse_args()
    plans = sorted((REPO / "plans").glob("*.yaml"))
    opens, lsp = asyncio.run(measure(plans, args.changes))
    cli = cli_times(plans, args.cli_runs)
    print(f"{len(plans)} shipped plans, change -> diagnostics of that version")
    print(f"planc lsp, didOpen (the first waits warm-up) {summary(opens).replace('changes', 'opens')}")
    print(f"planc lsp (one process)                    {summary(lsp)}")
    print(f"planc lint --stdin-filename (per process)  {summary(cli)}")
    print(f"ratio of medians lsp / lint process: {statistics.median(lsp) / statistics.median(cli):.3f}")
    print(f"budget 300 ms: max {max(lsp) * 1e3:.1f} ms {'within' if max(lsp) < 0.3 else 'OVER'}")


if __name__ == "__main__":
    main()
