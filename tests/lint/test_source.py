"""Bad input becomes a diagnostic with a position, never a traceback, and nothing is executed."""

from __future__ import annotations


import pytest

from planc.lint.runner import lint_file, lint_text
from planc.spec.source import MAX_PLAN_BYTES, SourceError, parse_yaml

from .helpers import GOOD, codes


def one(diags, code):
    assert [d.code for d in diags] == [code], [d.format() for d in diags]
    return diags[0]


def test_invalid_yaml_reports_its_line():
    d = one(lint_text("version: 1\nmodel: {type: mixtral}\nparallel: [tp_size: 2\n", "p.yaml"), "PLC001")
    assert d.line >= 3 and d.path == "p.yaml" and "invalid YAML" in d.message


def test_tab_indentation():
    d = one(lint_text("version: 1\nmodel:\n  type: mixtral\nparallel:\n\ttp_size: 2\n"), "PLC005")
    assert (d.line, d.col) == (5, 1)
    assert "spaces" in d.hint


def test_tabs_inside_values_and_comments_are_fine():
    text = GOOD.replace("version: 1", "version: 1\t# tab before a comment") + "description: \"a\\tb\tc\"\n"
    assert lint_text(text) == []


def test_non_utf8_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_bytes(b"version: 1\nname: caf\xe9\n")
    d = one(lint_file(str(p)), "PLC003")
    assert (d.line, d.col) == (2, 10)


def test_utf8_bom_is_accepted(tmp_path):
    p = tmp_path / "bom.yaml"
    p.write_bytes(b"\xef\xbb\xbf" + GOOD.encode())
    assert lint_file(str(p)) == []


def test_file_over_one_mib(tmp_path):
    p = tmp_path / "big.yaml"
    p.write_bytes(GOOD.encode() + b"#" * MAX_PLAN_BYTES)
    one(lint_file(str(p)), "PLC004")
    one(lint_text(GOOD + "#" * MAX_PLAN_BYTES), "PLC004")


def test_text_over_one_mib_of_bytes_in_fewer_characters(tmp_path):
    text = GOOD + "#" + "é" * (MAX_PLAN_BYTES // 2) + "\n"  # fewer characters than MAX_PLAN_BYTES, more bytes
    assert len(text) < MAX_PLAN_BYTES < len(text.encode())
    one(lint_text(text), "PLC004")
    p = tmp_path / "big.yaml"
    p.write_text(text, encoding="utf-8")
    one(lint_file(str(p)), "PLC004")


def test_missing_file_and_directory_as_file(tmp_path):
    one(lint_file(str(tmp_path / "nope.yaml")), "PLC002")
    one(lint_file(str(tmp_path)), "PLC002")


BILLION_LAUGHS = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)
)


def test_billion_laughs_is_rejected_after_bounded_work(monkeypatch):
    """The converter stops at MAX_NODES values instead of expanding 10**9: bounded work, not a timing."""
    from planc.spec import source

    visited = []
    original = source._Converter.convert

    def counting(self, node, keypath, depth):
        visited.append(1)
        return original(self, node, keypath, depth)

    monkeypatch.setattr(source._Converter, "convert", counting)
    d = one(lint_text(BILLION_LAUGHS), "PLC007")
    assert "alias" in d.message
    assert 1000 < len(visited) <= source.MAX_NODES + 1


def test_string_alias_bomb_is_capped():
    text = f"a: &a {'x' * 500_000}\nb: [{', '.join(['*a'] * 20)}]\n"
    one(lint_text(text), "PLC007")


def test_recursive_alias():
    one(lint_text("a: &a [1, *a]\n"), "PLC007")
    one(lint_text("a: &a {b: *a}\n"), "PLC007")


def test_deep_nesting():
    assert codes(lint_text("a: " + "[" * 5000 + "]" * 5000 + "\n")) in (["PLC001"], ["PLC007"])
    one(lint_text("a: " + "[" * 100 + "]" * 100 + "\n"), "PLC007")


def test_small_aliases_are_expanded():
    text = GOOD.replace("parallel: {tp_size: 2, ep_size: 2}", "parallel: &p {tp_size: 2, ep_size: 2}")
    assert lint_text(text) == []


@pytest.mark.parametrize(
    "value",
    [
        "!!python/object/apply:os.system ['touch {marker}']",
        "!!python/object/new:os.system ['touch {marker}']",
        "!!python/name:os.system",
        "!!binary aGVsbG8=",
        "!!set {{a, b}}",
        "!!omap [a: 1]",
        "!custom thing",
        "!!int abc",
    ],
)
def test_tags_never_build_objects(value, tmp_path):
    marker = tmp_path / "executed"
    d = one(lint_text(f"version: 1\nname: {value.format(marker=marker)}\n"), "PLC006")
    assert d.line == 2
    assert not marker.exists()


def test_merge_keys_are_refused():
    text = "base: &b {tp_size: 2}\nparallel:\n  <<: *b\n"
    d = one(lint_text(text), "PLC006")
    assert "extends" in d.hint and d.line == 3


def test_dates_stay_text_and_a_plain_date_is_ambiguous():
    # YAML 1.2 reads a plain date as text, PyYAML (YAML 1.1) as a date: quote it
    assert lint_text(GOOD + "name: '2024-01-01'\n") == []
    assert [d.code for d in lint_text(GOOD + "name: 2024-01-01\n")] == ["PLC011"]
    assert parse_yaml("a: 2024-01-01\n").data == {"a": "2024-01-01"}


@pytest.mark.parametrize(
    "text, code",
    [
        ("", "PLC009"),
        ("# only a comment\n", "PLC009"),
        ("- a\n- b\n", "PLC009"),
        ("just text\n", "PLC009"),
        ("a: 1\n---\nb: 2\n", "PLC001"),
        ("a: 1\x00\n", "PLC001"),
        ("a: \x07\n", "PLC001"),
        ("? [a, b]\n: c\n", "PLC001"),
        ("~: 1\n", "PLC001"),
        ("a: *undefined\n", "PLC001"),
        ("a: 'unterminated\n", "PLC001"),
    ],
)
def test_malformed_documents(text, code):
    one(lint_text(text), code)


def test_duplicate_top_level_key():
    text = GOOD + "parallel: {tp_size: 4}\n"
    d = one(lint_text(text), "PLC008")
    assert d.line == 10 and "first at line 3" in d.message


def test_duplicate_nested_key_and_lint_continues():
    text = GOOD.replace("parallel: {tp_size: 2, ep_size: 2}", "parallel: {tp_size: 2, ep_size: 2, tp_size: 3}")
    text = text.replace("rowwise", "rowwize")
    assert sorted(codes(lint_text(text))) == ["PLC008", "PLC310"]


def test_positions_of_keys_and_values():
    doc = parse_yaml("a:\n  b: [1, 2]\n  c: x\n", "f.yaml")
    assert str(doc.key_position(("a", "c"))) == "f.yaml:3:3"
    assert str(doc.value_position(("a", "c"))) == "f.yaml:3:6"
    assert str(doc.value_position(("a", "b", 1))) == "f.yaml:2:10"
    assert str(doc.position(("a", "zzz"))) == "f.yaml:1:1"


def test_parse_yaml_raises_source_error_with_code():
    with pytest.raises(SourceError) as err:
        parse_yaml("a: [\n", "x.yaml")
    assert err.value.code == "PLC001" and err.value.position.path == "x.yaml"
