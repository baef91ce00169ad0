"""`--device-memory`: `80GB` is decimal, `80GiB` binary, a card name the memory torch reports for that card, and
the output says which reading was taken."""

from __future__ import annotations

import re

import pytest

from planc.cli import main
from planc.compiler.devices import CARDS, read_device_memory
from tests.checkout_env import REPO

MIXTRAL = [str(REPO / "plans" / "mixtral.yaml"), "--set", "num_hidden_layers=2"]


@pytest.mark.parametrize("given, read", [
    ("80GB", "80GB read as decimal units (10^9 bytes a GB): 74.51 GiB; write 80GiB for binary units"),
    ("80GiB", "80GiB read as binary units (2^30 bytes a GiB): 80.00 GiB"),
    ("H100", "H100 read as the NVIDIA H100 80GB HBM3 (SXM): 79.18 GiB (torch.cuda.get_device_properties(0)"),
])
def test_explain_says_how_the_device_memory_was_read(given, read, capsys):
    assert main(["explain", *MIXTRAL, "--device-memory", given]) == 0
    out = capsys.readouterr().out
    assert read in out, out


def test_explain_json_carries_the_reading(capsys):
    import json

    assert main(["explain", *MIXTRAL, "--device-memory", "h200", "--format", "json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["device_memory"] == CARDS["h200"].memory
    assert memory["device_memory_read"].startswith("h200 read as the NVIDIA H200")


def test_a_name_that_is_neither_a_size_nor_one_card_is_a_usage_error(capsys):
    assert main(["explain", *MIXTRAL, "--device-memory", "A100"]) == 2
    assert "names several cards: write one of A100-80GB, A100-40GB" in capsys.readouterr().err
    assert main(["explain", *MIXTRAL, "--device-memory", "80 gigs"]) == 2
    err = capsys.readouterr().err
    assert "write a size (80GiB: 2^30 bytes a GiB, 80GB: 10^9 bytes a GB, or bytes) or a card: H100, H200" in err, err
    with pytest.raises(ValueError, match="needs some memory"):
        read_device_memory("0")


def test_help_names_both_units_and_the_cards(capsys):
    assert main(["explain", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "80GiB = 80 * 2^30 bytes, 80GB = 80 * 10^9 bytes" in text and "H100, H200, B200" in text, text


def test_the_docs_table_is_the_cards_table():
    """docs/memory.md lists every card with the bytes planc uses for it."""
    text = (REPO / "docs" / "memory.md").read_text()
    rows = dict(re.findall(r"^  \| `([^`]+)` \| (\d+) \|", text, re.M))
    assert rows == {c.name: str(c.memory) for c in CARDS.values()}
