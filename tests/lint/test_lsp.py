"""planc in the editor: the real `planc lsp` and the real yaml-language-server (with only the plan schema), each
driven over stdio by pygls' LSP client (tests/lint/lsp_client.py), on broken variants of plans/mixtral.yaml.

- `planc lsp` publishes the same codes on the same lines as `planc lint --stdin-filename` on every case (a
  problem in a parent plan goes on the `extends:` line, naming the parent's line), and its quick fixes
  (migrate's rewrite, a did-you-mean) give a clean plan.
- yaml-language-server, with the schema only, shows a diagnostic on a line planc reports for every case the
  schema can express, names a missing `parallel`, and offers each table's styles with their own docs.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

pytest.importorskip("pygls", reason="the LSP tests need pygls (the planc[lsp] extra)")
pytestmark = pytest.mark.xdist_group("lsp")  # one worker: each server process starts once

from planc.spec.styles import STYLE, TABLE_STYLES  # noqa: E402

from tests.checkout_env import checkout_env  # noqa: E402

from .helpers import PLANS, REPO  # noqa: E402
from .lsp_client import Editor, apply_edits, yaml_language_server  # noqa: E402

MIXTRAL = (REPO / "plans" / "mixtral.yaml").read_text()


def edit(*pairs: tuple[str, str]) -> Callable[[str], str]:
    def apply(text: str) -> str:
        for old, new in pairs:
            assert old in text, old
            text = text.replace(old, new, 1)
        return text
    return apply


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[str], str]  # mixtral's text -> the broken buffer
    codes: frozenset  # codes planc must report (at least)
    schema: bool  # the JSON Schema can express it: yaml-language-server alone shows it


MEGAMOE = ("implementation: grouped_mm", "implementation: deepgemm_megamoe")
ALL_TO_ALL = ("ep_implementation: auto", "ep_implementation: all_to_all")
CASES = [
    # twenty ways a buffer breaks while being typed, each with the codes planc reports for it
    Case("megamoe_with_all_to_all", edit(MEGAMOE, ALL_TO_ALL), frozenset({"PLC400"}), True),
    Case("unclosed_brace", edit(("{q,k,v}_proj", "{q,k,v_proj")), frozenset({"PLC300"}), True),
    Case("hex_size", edit(("tp_size: 8", "tp_size: 0x10")), frozenset({"PLC011"}), False),
    Case("name_yes", edit(("name: mixtral-tp8-ep8", "name: yes")), frozenset({"PLC011"}), False),
    Case("ep_style_in_tp_plan", edit(("lm_head: colwise_gather_output", "model.layers.*.mlp.experts: grouped_gemm")),
         frozenset({"PLC311", "PLC406"}), True),
    Case("ep_size_3", edit(("ep_size: 8", "ep_size: 3")), frozenset({"PLC500", "PLC501"}), False),
    Case("extends_missing", lambda _: "extends: nowhere.yaml\nname: child\n", frozenset({"PLC202"}), False),
    Case("extends_conflict", lambda _: "extends: a2a_parent.yaml\nexperts:\n  implementation: deepgemm_megamoe\n",
         frozenset({"PLC400"}), False),
    Case("extends_shipped_without_ep", lambda _: "extends: planc:mixtral\nparallel: {ep_size: 1}\n",
         frozenset({"PLC405"}), False),
    Case("extends_shipped_missing", lambda _: "version: 1\nextends: planc:mixtrl\n", frozenset({"PLC202"}), False),
    Case("unknown_model_type", edit(("type: mixtral", "type: mixtrl")), frozenset({"PLC110"}), False),
    Case("no_parallel", edit(("parallel:\n  tp_size: 8\n  ep_size: 8\n", "")), frozenset({"PLC100"}), True),
    Case("unknown_style", edit(("o_proj: rowwise", "o_proj: row_wise")), frozenset({"PLC310"}), True),
    Case("unknown_key", edit(("ep_size: 8", "ep_szie: 8")), frozenset({"PLC101"}), True),
    Case("tp_size_zero", edit(("tp_size: 8", "tp_size: 0")), frozenset({"PLC104"}), True),
    Case("tp_size_string", edit(("tp_size: 8", 'tp_size: "8"')), frozenset({"PLC102"}), True),
    Case("version_2", edit(("version: 1", "version: 2")), frozenset({"PLC105"}), True),
    Case("bad_implementation", edit(("grouped_mm", "grouped_mmm")), frozenset({"PLC103"}), True),
    Case("yaml_syntax", edit(("  type: mixtral\n", "  type: [mixtral\n")), frozenset({"PLC001"}), True),
    Case("duplicate_pattern", edit(("  lm_head: colwise_gather_output\n",
                                    "  lm_head: colwise_gather_output\n  lm_head: colwise\n")),
         frozenset({"PLC008"}), True),
    Case("tab_indent", edit(("  type: mixtral", "\ttype: mixtral")), frozenset({"PLC005"}), True),
    Case("removed_style", edit(("experts: ep_dispatch_experts", "experts: megamoe_experts")),
         frozenset({"PLC320"}), True),
    Case("tp_style_in_ep_plan", edit(("  model.layers.*.mlp.experts: ep_dispatch_experts\n",
                                      "  model.layers.*.mlp.experts: ep_dispatch_experts\n"
                                      "  model.layers.*.self_attn.o_proj: rowwise\n")),
         frozenset({"PLC312"}), True),
    # more: every pairing of planc/spec/pairings.py, and the EP rules the schema cannot see
    Case("megamoe_ep_with_grouped_mm", edit(("ep_implementation: auto", "ep_implementation: deepgemm_megamoe")),
         frozenset({"PLC401"}), True),
    Case("training_megamoe", edit(MEGAMOE, ("experts:\n", "training: {data_parallel: fsdp}\nexperts:\n")),
         frozenset({"PLC700"}), True),
    Case("mixed_precision_replicate",
         edit(("experts:\n", "training:\n  mixed_precision: {param_dtype: bfloat16}\nexperts:\n")),
         frozenset({"PLC701"}), True),
    Case("megamoe_block_grouped_mm", edit(("  ep_implementation: auto", "  megamoe: {backend: reference}\n"
                                          "  ep_implementation: auto")), frozenset({"PLC403"}), True),
    Case("removed_router", edit(("  model.layers.*.mlp.experts: ep_dispatch_experts\n",
                                 "  model.layers.*.mlp.experts: ep_dispatch_experts\n"
                                 "  model.layers.*.mlp.gate: megamoe_router\n")), frozenset({"PLC320"}), True),
    Case("missing_dispatch", edit(("  model.layers.*.mlp.experts: ep_dispatch_experts\n", "")),
         frozenset({"PLC404"}), False),
    Case("dispatch_without_ep", edit(("ep_size: 8", "ep_size: 1")), frozenset({"PLC405"}), False),
    Case("tp_rule_on_ep_experts", edit(("  lm_head: colwise_gather_output\n", "  lm_head: colwise_gather_output\n"
                                        "  model.layers.*.mlp.experts.down_proj: rowwise\n")),
         frozenset({"PLC406"}), False),
]
IDS = [c.name for c in CASES]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A checkout-like tree: schemas/ and plans/ (the modeline's relative `$schema` resolves), one parent plan."""
    root = tmp_path_factory.mktemp("editor")
    (root / "schemas").mkdir()
    shutil.copy(REPO / "schemas" / "plan.schema.json", root / "schemas")
    (root / "plans").mkdir()
    (root / "plans" / "a2a_parent.yaml").write_text(MIXTRAL.replace("ep_implementation: auto", "ep_implementation: all_to_all"))
    return root


@pytest.fixture(scope="module")
def planc_lsp(root):
    with Editor([sys.executable, "-m", "planc", "lsp"], root, env=checkout_env()) as editor:
        yield editor


@pytest.fixture(scope="module")
def yls(root):
    command = yaml_language_server()
    if command is None:
        pytest.skip("yaml-language-server needs node, which is not installed (.ci/run installs both)")
    with Editor(command, root, env=checkout_env()) as editor:
        yield editor


@functools.cache
def lint_json(text: str, path: Path) -> list[dict]:
    """`planc lint --stdin-filename PATH --format json` on the buffer: what the editor must agree with."""
    r = subprocess.run([sys.executable, "-m", "planc", "lint", "--stdin-filename", str(path), "--format", "json"],
                       input=text, capture_output=True, text=True, env=checkout_env(), cwd=REPO, timeout=60)
    assert r.returncode in (0, 1), r.stderr
    return json.loads(r.stdout)["diagnostics"]


def buffer(root: Path, case: Case) -> tuple[Path, str]:
    return root / "plans" / f"{case.name}.yaml", case.make(MIXTRAL)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_planc_lsp_reports_what_lint_reports(planc_lsp, root, case):
    path, text = buffer(root, case)
    assert not path.exists()  # the buffer is linted, not a file
    want = lint_json(text, path)
    assert case.codes <= {d["code"] for d in want}, want
    got = planc_lsp.diagnostics(planc_lsp.open(path, text))
    here = {(d["code"], d["line"]) for d in want if d["path"] == str(path)}
    assert {(d.code, d.range.start.line + 1) for d in got if not d.related_information} == here
    elsewhere = {(d["code"], d["path"], d["line"]) for d in want if d["path"] != str(path)}
    shown = {(d.code, Path(d.related_information[0].location.uri[len("file://"):]).as_posix(),
              d.related_information[0].location.range.start.line + 1) for d in got if d.related_information}
    assert shown == elsewhere
    if elsewhere:  # on the `extends:` line of the plan being edited
        assert {d.range.start.line for d in got if d.related_information} == {0}
    for d in got:  # the whole offending node, start and end
        assert (d.range.end.line, d.range.end.character) > (d.range.start.line, d.range.start.character)
    wanted = {(d["code"], d["line"]): d for d in want}
    for d in got:
        if not d.related_information:
            w = wanted[(d.code, d.range.start.line + 1)]
            assert d.range.start.character == w["col"] - 1 and w["message"] in d.message and w["hint"] in d.message


@pytest.mark.parametrize("case", [c for c in CASES if c.schema], ids=[c.name for c in CASES if c.schema])
def test_schema_alone_shows_what_it_can_express(yls, root, case):
    path, text = buffer(root, case)
    lines = {d["line"] for d in lint_json(text, path)}
    got = yls.diagnostics(yls.open(path, text), settle=0.3)
    if case.name == "no_parallel":  # on the document (planc: line 1, the editor: the first key): named
        assert any('"parallel"' in d.message for d in got) and not any("extends" in d.message for d in got), got
    else:
        assert {d.range.start.line + 1 for d in got} & lines, [(d.range.start.line + 1, d.message) for d in got]


def test_shipped_plans_are_clean_in_both(planc_lsp, yls):
    for plan in PLANS:
        text = plan.read_text()
        assert planc_lsp.diagnostics(planc_lsp.open(plan, text)) == [], plan
        assert yls.diagnostics(yls.open(plan, text), settle=0.3) == [], plan


def test_planc_lsp_follows_the_buffer_as_it_changes(planc_lsp, root):
    path = root / "plans" / "typing.yaml"
    uri = planc_lsp.open(path, MIXTRAL)
    assert planc_lsp.diagnostics(uri, 1) == []
    planc_lsp.change(uri, MIXTRAL.replace("ep_size: 8", "ep_size: 3"))
    assert {d.code for d in planc_lsp.diagnostics(uri, 2)} == {"PLC500", "PLC501"}
    planc_lsp.change(uri, MIXTRAL)
    assert planc_lsp.diagnostics(uri, 3) == []


def test_planc_lsp_lints_children_again_when_a_parent_is_saved(planc_lsp, root):
    parent = root / "plans" / "saved_parent.yaml"
    parent.write_text(MIXTRAL)
    child = planc_lsp.open(root / "plans" / "saved_child.yaml", "extends: saved_parent.yaml\nname: child\n")
    assert planc_lsp.diagnostics(child, 1) == []
    broken = MIXTRAL.replace("ep_size: 8", "ep_size: 3")
    parent_uri = planc_lsp.open(parent, broken)
    parent.write_text(broken)
    planc_lsp.save(parent_uri)
    found = planc_lsp.diagnostics(child, 2)
    assert {d.code for d in found} == {"PLC500", "PLC501"} and {d.range.start.line for d in found} == {0}
    assert all("saved_parent.yaml:11:" in d.message for d in found)


def _fix(editor: Editor, path: Path, text: str, title: str) -> str:
    uri = editor.open(path, text)
    diagnostics = editor.diagnostics(uri)
    actions = editor.code_actions(uri, diagnostics)
    chosen = [a for a in actions if a.title == title]
    assert chosen, [a.title for a in actions]
    return apply_edits(text, chosen[0].edit.changes[uri])


@pytest.mark.parametrize("name", ["removed_style", "removed_router"])
def test_quick_fix_for_removed_styles_gives_a_clean_plan(planc_lsp, root, name):
    from planc.lint.lsp import MIGRATE_TITLE

    case = next(c for c in CASES if c.name == name)
    path, text = buffer(root, case)
    path = path.with_name(f"fix_{name}.yaml")
    fixed = _fix(planc_lsp, path, text, MIGRATE_TITLE)
    assert fixed != text and lint_json(fixed, path) == []
    uri = path.as_uri()
    planc_lsp.change(uri, fixed)
    assert planc_lsp.diagnostics(uri, 2) == []


@pytest.mark.parametrize("name, word", [("unknown_style", "rowwise"), ("unknown_key", "ep_size"),
                                        ("bad_implementation", "grouped_mm"), ("unknown_model_type", "mixtral")])
def test_did_you_mean_quick_fix(planc_lsp, root, name, word):
    case = next(c for c in CASES if c.name == name)
    path, text = buffer(root, case)
    fixed = _fix(planc_lsp, path.with_name(f"fix_{name}.yaml"), text, f"Replace with `{word}`")
    assert fixed == MIXTRAL


@pytest.mark.parametrize("table, line", [("tp_plan", "  lm_head: colwise_gather_output\n"),
                                         ("ep_plan", "  model.layers.*.mlp.experts: ep_dispatch_experts\n")])
def test_schema_completes_each_tables_styles_with_their_docs(yls, root, table, line):
    key = line.split(": ")[0]
    text = MIXTRAL.replace(line, f"{key}: \n")
    row = text.splitlines().index(f"{key}: ")
    uri = yls.open(root / "plans" / f"complete_{table}.yaml", text)
    yls.diagnostics(uri, settle=0.3)
    found = yls.completion(uri, row, len(key) + 2)
    items = found.items if hasattr(found, "items") else found
    docs = {i.label: getattr(i.documentation, "value", i.documentation) for i in items}
    assert docs == TABLE_STYLES[table]  # only the styles legal in this table, each with its own doc


def test_schema_hover_on_a_style_explains_it(yls, root):
    row = MIXTRAL.splitlines().index("  model.layers.*.self_attn.o_proj: rowwise")
    uri = yls.open(root / "plans" / "hover.yaml", MIXTRAL)
    yls.diagnostics(uri, settle=0.3)
    hover = yls.hover(uri, row, len("  model.layers.*.self_attn.o_proj: ro"))
    text = hover.contents.value
    first = text.index("* `")
    assert text[first:].startswith(f"* `rowwise`: {STYLE['rowwise'].doc}")  # the hovered style first, its own doc
    assert "grouped_gemm" not in text  # a tp_plan value: only tensor-parallel styles


def test_schema_hover_on_a_pattern_gives_the_pattern_syntax(yls, root):
    from planc.spec.patterns import PATTERN_SYNTAX

    row = MIXTRAL.splitlines().index("  model.layers.*.self_attn.o_proj: rowwise")
    uri = yls.open(root / "plans" / "hover_pattern.yaml", MIXTRAL)
    yls.diagnostics(uri, settle=0.3)
    shown = yls.hover(uri, row, 8).contents.value.replace("\\", "")  # markdown escapes `*`, `_`, `{`
    assert PATTERN_SYNTAX in shown
