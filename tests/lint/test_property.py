"""Property tests: whatever the input, lint returns diagnostics (registered codes, real positions)
and never raises; PLC000 (a crashed check) counts as a failure."""

from __future__ import annotations

import os
import tempfile

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from planc.lint.diagnostic import Diagnostic
from planc.lint.registry import get
from planc.lint.runner import lint_file, lint_text
from planc.spec.styles import ALL_STYLES, REMOVED_STYLES

from .helpers import PLANS

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

WORDS = [
    "version", "name", "extends", "model", "type", "parallel", "tp_size", "ep_size", "dp_size", "experts",
    "implementation", "ep_implementation", "megamoe", "backend", "max_tokens_per_rank", "activation_clamp",
    "quantize", "tp_plan", "ep_plan", "auto", "all_to_all", "all_reduce", "deepgemm_megamoe", "grouped_mm",
    "model.layers.*.mlp.experts", "model.layers.*.mlp.experts.{gate_up_proj,down_proj}", "a..b", "{x", "*",
    *ALL_STYLES, *REMOVED_STYLES,
]
scalars = st.one_of(
    st.sampled_from(WORDS), st.integers(-3, 20), st.booleans(), st.none(), st.floats(allow_nan=False),
    st.text(max_size=12),
)
keys = st.one_of(st.sampled_from(WORDS), st.text(min_size=1, max_size=10), st.integers(0, 3))
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=6)),
    max_leaves=25,
)


def check(diags, text=None):
    assert isinstance(diags, list)
    for d in diags:
        assert isinstance(d, Diagnostic)
        assert d.code != "PLC000", (d.format(), text)
        assert get(d.code) is not None, d.code
        assert d.position is not None and d.line >= 1 and d.col >= 1 and d.message and d.hint


@SETTINGS
@given(documents)
def test_random_documents(doc):
    text = yaml.safe_dump(doc, allow_unicode=True)
    check(lint_text(text, "random.yaml"), text)


@SETTINGS
@given(st.dictionaries(st.sampled_from(WORDS), documents, max_size=8))
def test_random_plan_shaped_documents(doc):
    doc.setdefault("version", 1)
    text = yaml.safe_dump(doc)
    check(lint_text(text), text)


@SETTINGS
@given(st.text(max_size=200))
@example("{}")  # an empty flow mapping: no key to point at, still a position (the root value's)
def test_random_text(text):
    check(lint_text(text), text)


def _mutate(text: str, data) -> str:
    lines = text.split("\n")
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["delete", "duplicate", "swap", "char", "insert", "word", "indent", "truncate"]))
        i = data.draw(st.integers(0, max(len(lines) - 1, 0)))
        if not lines:
            lines = [""]
        if op == "delete":
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, lines[i])
        elif op == "swap":
            j = data.draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "char" and lines[i]:
            k = data.draw(st.integers(0, len(lines[i]) - 1))
            c = data.draw(st.sampled_from(list(":-{}[],*&!|>'\"#%@`\t ") + ["\x00", "é", "\n"]))
            lines[i] = lines[i][:k] + c + lines[i][k + 1 :]
        elif op == "insert":
            lines.insert(i, data.draw(st.text(max_size=30)))
        elif op == "word" and ": " in lines[i]:
            head = lines[i].split(": ", 1)[0]
            lines[i] = f"{head}: {data.draw(st.sampled_from(WORDS + ['0', '-1', '9', '[]', '{}', '*a', '&a x']))}"
        elif op == "indent":
            lines[i] = data.draw(st.sampled_from(["", " ", "  ", "    ", "\t"])) + lines[i].lstrip()
        elif op == "truncate":
            lines = lines[: i + 1]
    return "\n".join(lines)


@SETTINGS
@given(st.sampled_from(PLANS), st.data())
def test_mutations_of_shipped_plans(path, data):
    text = _mutate(path.read_text(), data)
    check(lint_text(text, str(path)), text)  # the path anchors `extends` next to the shipped plan


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(PLANS), st.binary(max_size=8), st.integers(0, 2000))
def test_byte_mutations_of_shipped_plans(path, junk, at):
    raw = path.read_bytes()
    at = min(at, len(raw))
    with tempfile.TemporaryDirectory() as tmp:
        target = os.path.join(tmp, path.name)
        with open(target, "wb") as f:
            f.write(raw[:at] + junk + raw[at:])
        check(lint_file(target))
