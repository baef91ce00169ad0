"""Safe YAML with source positions.

A plan file is untrusted input (pre-commit runs the linter on whatever is staged), so this module
turns bytes into plain data without ever building a Python object from a tag, without expanding
aliases past a fixed budget, and with the `file:line:col` of every key and value kept for the
diagnostics. Problems that stop parsing raise `SourceError`; problems that do not (a key written
twice) are collected in `SourceDoc.problems` so the linter can report them next to everything else.

The codes used here are documented by the `source` rule family in `planc.lint.rules_source`.
"""

from __future__ import annotations

import functools
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from planc.errors import PlancError

MAX_PLAN_BYTES = 1 << 20  # plans are a few hundred bytes; 1 MiB is generous and bounds parse time
MAX_NODES = 50_000  # values after alias expansion: bounds the work on a billion-laughs document
MAX_SCALAR_CHARS = 4 << 20  # characters of scalars after alias expansion (aliases of one long string)
MAX_DEPTH = 64  # nesting of mappings/sequences: a plan needs 3

# Codes (documented in planc.lint.rules_source).
YAML_SYNTAX = "PLC001"
UNREADABLE = "PLC002"
NOT_UTF8 = "PLC003"
TOO_LARGE = "PLC004"
TAB_INDENT = "PLC005"
UNSAFE_TAG = "PLC006"
ALIAS_LIMIT = "PLC007"
DUPLICATE_KEY = "PLC008"
NOT_A_MAPPING = "PLC009"
AMBIGUOUS_SCALAR = "PLC011"
KEY_NOT_STRING = "PLC012"

try:  # libyaml: 10x faster, caps nesting in C
    from yaml import CSafeLoader as _BaseLoader
except ImportError:  # a PyYAML built without libyaml
    from yaml import SafeLoader as _BaseLoader  # type: ignore[assignment]

_TAG = "tag:yaml.org,2002:"
_PLAIN_TAGS = {_TAG + t for t in ("str", "int", "float", "bool", "null", "timestamp")}
_AMBIGUOUS = "tag:planc.invalid,2026:yaml-1.1-and-1.2-disagree"  # never written by a user: resolver output

# YAML 1.2 core schema (what editors' yaml-language-server and JSON Schema tools assume), per the spec's
# table 10.2.2. Anything else in plain style is a string.
_CORE_NULL = re.compile(r"~|null|Null|NULL|")
_CORE_BOOL = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}
_CORE_INT = re.compile(r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+")
_CORE_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)")
_DECIMAL_INT = re.compile(r"[-+]?(0|[1-9][0-9]*)")


def core_scalar(text: str) -> Any:
    """The YAML 1.2 core-schema value of a plain scalar."""
    if _CORE_NULL.fullmatch(text):
        return None
    if text in _CORE_BOOL:
        return _CORE_BOOL[text]
    if _CORE_INT.fullmatch(text):
        if text.startswith(("0o", "0x")):
            return int(text[2:], 8 if text[1] == "o" else 16)
        return int(text, 10)
    if _CORE_FLOAT.fullmatch(text):
        return float(text.replace(".inf", "inf").replace(".Inf", "inf").replace(".INF", "inf").replace(".nan", "nan")
                     .replace(".NaN", "nan").replace(".NAN", "nan"))
    return text


_RESOLVER_11 = yaml.resolver.Resolver()
_CONSTRUCTOR_11 = yaml.constructor.SafeConstructor()
_CONSTRUCT_11 = {
    "null": _CONSTRUCTOR_11.construct_yaml_null, "bool": _CONSTRUCTOR_11.construct_yaml_bool,
    "int": _CONSTRUCTOR_11.construct_yaml_int, "float": _CONSTRUCTOR_11.construct_yaml_float,
    "timestamp": _CONSTRUCTOR_11.construct_yaml_timestamp,
}


def yaml11_scalar(text: str) -> Any:
    """What PyYAML (YAML 1.1, and most Python tools) makes of the same plain scalar."""
    construct = _CONSTRUCT_11.get(_RESOLVER_11.resolve(yaml.ScalarNode, text, (True, False)).rsplit(":", 1)[-1])
    if construct is None:
        return text
    try:
        return construct(yaml.ScalarNode(_TAG, text))
    except (ValueError, OverflowError, yaml.YAMLError):
        return text


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    return a == b or (isinstance(a, float) and a != a and b != b)


@functools.lru_cache(maxsize=4096)
def ambiguity(text: str) -> Optional[tuple[str, str]]:
    """(message, hint) when YAML 1.1 and 1.2 tools would read a plain scalar differently, or an integer is
    not written in plain decimal; None when every tool reads it the same."""
    v12, v11 = core_scalar(text), yaml11_scalar(text)
    if _same(v12, v11):
        if isinstance(v12, int) and not isinstance(v12, bool) and not _DECIMAL_INT.fullmatch(text):
            return (f"`{text}` is the integer {v12} written in another base; plans write integers in decimal",
                    f"write `{v12}`")
        return None
    message = (f"`{text}` is {_describe(v12)} in YAML 1.2 (editors, check-jsonschema, planc) but {_describe(v11)} "
               "in YAML 1.1 (PyYAML and the tools built on it)")
    options = []
    for v in (v12, v11):
        if isinstance(v, bool):
            options.append(f"`{str(v).lower()}`")
        elif isinstance(v, (int, float)) and v == v and abs(v) != float("inf"):
            options.append(f"`{v}`")
    options = list(dict.fromkeys(options))
    hint = f"quote it (`'{text}'`) if you mean the text"
    if options:
        hint = f"write {' or '.join(options)} if you mean the {'boolean' if 'true' in options[0] or 'false' in options[0] else 'number'}, or " + hint
    return message, hint


def _describe(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"the boolean {str(v).lower()}"
    if isinstance(v, int):
        return f"the integer {v}"
    if isinstance(v, float):
        return f"the number {v}"
    if isinstance(v, str):
        return "a string"
    return f"a {type(v).__name__}"  # date, datetime


class _Loader(_BaseLoader):
    """libyaml's parser with YAML 1.2 core resolution of plain scalars; a plain scalar that YAML 1.1
    reads differently gets the private `_AMBIGUOUS` tag, which the converter reports (PLC011)."""

    def resolve(self, kind: type, value: str, implicit: tuple[bool, bool]) -> str:
        if kind is yaml.ScalarNode and implicit[0] and value != "<<":  # `<<`: merge key in 1.1 tools, refused
            if ambiguity(value) is not None:
                return _AMBIGUOUS
            v = core_scalar(value)
            return _TAG + ("null" if v is None else "bool" if isinstance(v, bool) else "int" if isinstance(v, int)
                           else "float" if isinstance(v, float) else "str")
        resolved: str = yaml.resolver.Resolver.resolve(self, kind, value, implicit)  # super(), typed
        return resolved


@dataclass(frozen=True)
class Position:
    """Where a key or value starts (1-based), and where it ends when the parser knows (editors underline the
    whole node); the end takes no part in equality, so a position built from `file:line:col` alone still matches."""

    path: Optional[str]
    line: int  # 1-based
    col: int  # 1-based
    end_line: Optional[int] = field(default=None, compare=False)  # 1-based, of the character after the node
    end_col: Optional[int] = field(default=None, compare=False)

    def __str__(self) -> str:
        return f"{self.path or '<string>'}:{self.line}:{self.col}"


KeyPath = tuple[Any, ...]  # e.g. ("experts", "ep_implementation") or ("tp_plan", "model.layers.*.q_proj")


class SourceError(PlancError):
    """YAML that cannot become a plan document: carries a code, a message, a hint and a position."""

    def __init__(self, code: str, message: str, hint: str, position: Position):
        super().__init__(f"{position}: {message}")
        self.code = code
        self.message = message
        self.hint = hint
        self.position = position


@dataclass
class SourceDoc:
    """Plain data of one YAML document plus the positions of its keys and values."""

    data: Any
    path: Optional[str]
    text: str
    key_positions: dict[KeyPath, Position] = field(default_factory=dict)  # Position of the key
    value_positions: dict[KeyPath, Position] = field(default_factory=dict)  # Position of the value
    problems: list[SourceError] = field(default_factory=list)  # non-fatal SourceErrors (duplicate keys)

    def key_position(self, keypath: KeyPath) -> Optional[Position]:
        return self.key_positions.get(tuple(keypath))

    def value_position(self, keypath: KeyPath) -> Optional[Position]:
        return self.value_positions.get(tuple(keypath))

    def position(self, keypath: KeyPath) -> Optional[Position]:
        """Best position for a key path: the key itself, else the nearest enclosing key."""
        return nearest_key_position(self.key_positions, keypath, self.path)


def nearest_key_position(key_positions: dict[KeyPath, Position], keypath: KeyPath, path: Optional[str]) -> Position:
    """Position of a key, else of the nearest enclosing key that was written, else the top of the file."""
    keypath = tuple(keypath)
    while keypath:
        pos = key_positions.get(keypath)
        if pos is not None:
            return pos
        keypath = keypath[:-1]
    return Position(path, 1, 1)


def read_text(path: str) -> str:
    """Read a plan file as UTF-8 text, refusing unreadable, oversized, non-UTF-8 and non-regular files."""
    return decode(read_bytes(path), path)


def read_bytes(path: str) -> bytes:
    """The bytes of a regular file of at most MAX_PLAN_BYTES, or a SourceError.

    The file is opened non-blocking and checked with fstat before the first read, so a FIFO, a
    socket or a device (`/dev/zero`) is refused at once instead of blocking a pre-commit hook
    forever, and a file swapped between a check and the open cannot slip through.
    """
    start = Position(path, 1, 1)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except IsADirectoryError:
        raise SourceError(UNREADABLE, "is a directory, not a plan file", "pass a .yaml file or a directory", start) from None
    except OSError as e:
        raise SourceError(
            UNREADABLE, f"cannot read plan: {e.strerror or e}", "check the path and its permissions", start
        ) from None
    except ValueError:  # an embedded NUL byte
        raise SourceError(UNREADABLE, "the path contains a NUL byte", "check the path", start) from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise SourceError(
                UNREADABLE, "is a directory, not a plan file", "pass a .yaml file or a directory", start
            )
        if not stat.S_ISREG(mode):
            raise SourceError(
                UNREADABLE,
                f"is not a regular file (a {_file_kind(mode)}); planc lints only regular files",
                "pass the plan file itself, not a pipe, socket or device",
                start,
            )
        with os.fdopen(fd, "rb") as f:
            fd = -1
            raw = f.read(MAX_PLAN_BYTES + 1)
    except OSError as e:
        raise SourceError(
            UNREADABLE, f"cannot read plan: {e.strerror or e}", "check the path and its permissions", start
        ) from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(raw) > MAX_PLAN_BYTES:
        raise SourceError(
            TOO_LARGE,
            f"plan file is larger than {MAX_PLAN_BYTES // (1 << 20)} MiB",
            "a plan is a few dozen lines: this is not a plan, or it needs trimming",
            start,
        )
    return raw


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def decode(raw: bytes, path: Optional[str] = None) -> str:
    """UTF-8 (an initial BOM is allowed) or a PLC003 diagnostic at the first bad byte."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line_start = raw.rfind(b"\n", 0, e.start) + 1
        line = raw.count(b"\n", 0, e.start) + 1
        col = len(raw[line_start : e.start].decode("utf-8", "replace")) + 1
        raise SourceError(
            NOT_UTF8,
            f"byte 0x{raw[e.start]:02x} is not valid UTF-8",
            "save the plan as UTF-8 text",
            Position(path, line, col),
        ) from None


def parse_yaml(text: str, path: Optional[str] = None) -> SourceDoc:
    """Parse one YAML document into a SourceDoc; raises SourceError for anything that is not plain data."""
    # The same byte bound as read_text(); a character is at most 4 UTF-8 bytes, so shorter text needs no encoding.
    if len(text) > MAX_PLAN_BYTES // 4 and len(text.encode("utf-8", "replace")) > MAX_PLAN_BYTES:
        raise SourceError(
            TOO_LARGE,
            f"plan text is larger than {MAX_PLAN_BYTES // (1 << 20)} MiB",
            "a plan is a few dozen lines",
            Position(path, 1, 1),
        )
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        node = yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as e:
        raise _syntax_error(text, path, e) from None
    except yaml.reader.ReaderError as e:  # a control character the YAML reader refuses
        line, col = _line_col(text, e.position)
        raise SourceError(
            YAML_SYNTAX,
            f"invalid YAML: character {e.character!r} is not allowed in YAML text",
            "remove the control character",
            Position(path, line, col),
        ) from None
    except RecursionError:  # pure-Python parser on very deep nesting (libyaml caps it itself)
        raise SourceError(
            YAML_SYNTAX, "invalid YAML: nesting is too deep", "a plan nests three levels deep", Position(path, 1, 1)
        ) from None
    except yaml.YAMLError as e:
        raise SourceError(YAML_SYNTAX, f"invalid YAML: {e}", "fix the YAML syntax", Position(path, 1, 1)) from None
    doc = SourceDoc(data=None, path=path, text=text)
    if node is not None:
        doc.data = _Converter(doc).convert(node, (), 0)
    return doc


def _line_col(text: str, index: int) -> tuple[int, int]:
    line = text.count("\n", 0, index) + 1
    return line, index - (text.rfind("\n", 0, index) + 1) + 1


_LEADING_TAB = re.compile(r"^ *\t", re.M)


def _syntax_error(text: str, path: Optional[str], e: yaml.MarkedYAMLError) -> SourceError:
    """A YAML syntax error; when a tab indents a line at or before it, the tab is the real cause."""
    mark = e.problem_mark or e.context_mark
    pos = Position(path, mark.line + 1, mark.column + 1) if mark else Position(path, 1, 1)
    for m in _LEADING_TAB.finditer(text):
        line, col = _line_col(text, m.end() - 1)
        if line > pos.line:
            break
        return SourceError(
            TAB_INDENT,
            "tab character used for indentation (YAML allows only spaces)",
            "indent with spaces, e.g. two per level",
            Position(path, line, col),
        )
    problem = (e.problem or str(e)).strip()
    context = f" ({e.context.strip()})" if e.context and e.problem else ""
    indent = _indentation_mistake(text, pos.line)
    if indent is not None:
        line, hint = indent
        return SourceError(YAML_SYNTAX, f"invalid YAML: line {line} is not indented like the lines around it "
                           f"({problem})", hint, Position(path, line, 1))
    return SourceError(YAML_SYNTAX, f"invalid YAML: {problem}{context}", "fix the YAML syntax at this position", pos)


def _indentation_mistake(text: str, line: int) -> Optional[tuple[int, str]]:
    """(line, hint) when the syntax error at `line` (1-based) comes from a `key: value` line indented unlike its
    neighbours: deeper than the entry above (not under a `key:` that opens a table), or between two levels.
    PyYAML reports such a line itself or the line after it."""
    lines = text.splitlines()

    def indent_of(s: str) -> int:
        return len(s) - len(s.lstrip(" "))

    def entry(i: int) -> bool:  # a `key: value` or `key:` line (not blank, not a comment)
        s = lines[i].strip() if 0 <= i < len(lines) else ""
        return bool(s) and not s.startswith("#") and ":" in s

    for i in (line - 1, line - 2):
        if not entry(i):
            continue
        above = next((j for j in range(i - 1, -1, -1) if entry(j)), None)
        if above is None:
            return None
        here, prev = indent_of(lines[i]), indent_of(lines[above])
        opens = lines[above].split("#")[0].rstrip().endswith(":")
        levels = sorted({indent_of(lines[j]) for j in range(above + 1) if entry(j)})
        if here > prev and not opens:
            want = prev
        elif here < prev and here not in levels:
            want = max((lv for lv in levels if lv < here), default=0)
            want = prev if prev - here <= 1 else want
        else:
            continue
        table = next((lines[j].strip().split(":")[0] for j in range(i - 1, -1, -1)
                      if entry(j) and indent_of(lines[j]) < want), None) if want else None
        under = f" (a rule of `{table}:`)" if table else ""
        return i + 1, (f"indent line {i + 1} by {want} space{'s' if want != 1 else ''}, like line {above + 1}{under}; "
                       "the entries of one table line up, each level two spaces deeper than its `key:` line")
    return None


class _Converter:
    """Nodes -> plain dict/list/scalars with positions, alias expansion bounded by a node budget."""

    def __init__(self, doc: SourceDoc):
        self.doc = doc
        self.nodes = 0
        self.chars = 0
        self.active: set[int] = set()  # ids of collections being converted (a recursive alias loops)

    def pos(self, node: yaml.Node) -> Position:
        start, end = node.start_mark, node.end_mark
        return Position(self.doc.path, start.line + 1, start.column + 1, end.line + 1, end.column + 1)

    def convert(self, node: yaml.Node, keypath: KeyPath, depth: int) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise SourceError(
                ALIAS_LIMIT,
                f"document expands to more than {MAX_NODES} values (alias bomb?)",
                "write the plan out without nested aliases; plans need no anchors",
                self.pos(node),
            )
        self.doc.value_positions.setdefault(keypath, self.pos(node))
        if isinstance(node, yaml.ScalarNode):
            return self.scalar(node)
        if depth >= MAX_DEPTH:
            raise SourceError(
                ALIAS_LIMIT, f"nesting deeper than {MAX_DEPTH} levels", "a plan nests three levels deep", self.pos(node)
            )
        if id(node) in self.active:
            raise SourceError(
                ALIAS_LIMIT, "recursive alias: a collection contains itself", "remove the alias", self.pos(node)
            )
        self.active.add(id(node))
        try:
            if isinstance(node, yaml.MappingNode):
                self.check_tag(node, "map")
                return self.mapping(node, keypath, depth)
            self.check_tag(node, "seq")
            return [self.convert(child, keypath + (i,), depth + 1) for i, child in enumerate(node.value)]
        finally:
            self.active.discard(id(node))

    def mapping(self, node: yaml.MappingNode, keypath: KeyPath, depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag == _TAG + "merge":
                raise SourceError(
                    UNSAFE_TAG,
                    "YAML merge keys (`<<`) are not supported in plans",
                    "write the keys out, or share settings with `extends: parent.yaml`",
                    self.pos(key_node),
                )
            if not isinstance(key_node, yaml.ScalarNode):
                raise SourceError(
                    YAML_SYNTAX, "mapping keys must be plain scalars", "write the key as a string", self.pos(key_node)
                )
            self.nodes += 1
            key = self.scalar(key_node)
            if key is None:
                raise SourceError(
                    YAML_SYNTAX, "a mapping key is empty or null", "write the key as a string", self.pos(key_node)
                )
            if not isinstance(key, str):  # every plan key is a name or a pattern; JSON has only string keys
                self.doc.problems.append(SourceError(
                    KEY_NOT_STRING,
                    f"key `{key_node.value}` is {_describe(key)}, not a string: plan keys are names and patterns",
                    f"quote it: `'{key_node.value}'`",
                    self.pos(key_node),
                ))
                key = key_node.value  # its text: `1` and `true` stay two keys, each at its own position
            kp = keypath + (key,)
            if key in out:
                first = self.doc.key_positions.get(kp)
                where = f" (first at line {first.line})" if first else ""
                table = keypath[0] if len(keypath) == 1 and keypath[0] in ("tp_plan", "ep_plan") else None
                what = f"pattern `{key}` appears twice in `{table}`" if table else f"key `{key}` appears twice"
                self.doc.problems.append(
                    SourceError(
                        DUPLICATE_KEY,
                        f"{what}{where}; YAML would silently keep the last one",
                        "keep one entry: remove this one or merge the two",
                        self.pos(key_node),
                    )
                )
                continue
            self.doc.key_positions[kp] = self.pos(key_node)
            out[key] = self.convert(value_node, kp, depth + 1)
        return out

    def check_tag(self, node: yaml.Node, kind: str) -> None:
        if node.tag != _TAG + kind:
            raise self.tag_error(node)

    def tag_error(self, node: yaml.Node) -> SourceError:
        return SourceError(
            UNSAFE_TAG,
            f"YAML tag {node.tag!r} is not allowed: plans hold plain strings, numbers, mappings and lists",
            "remove the tag; nothing in a plan is constructed or executed",
            self.pos(node),
        )

    def scalar(self, node: yaml.ScalarNode) -> Any:
        tag = node.tag
        if tag == _AMBIGUOUS:
            tag = _TAG + "int"  # any non-str tag: the ambiguity is reported below
        if tag not in _PLAIN_TAGS:
            raise self.tag_error(node)
        self.chars += len(node.value)
        if self.chars > MAX_SCALAR_CHARS:
            raise SourceError(
                ALIAS_LIMIT,
                "document text expands to more than 4 MiB through aliases",
                "write the plan out without aliases",
                self.pos(node),
            )
        if tag == _TAG + "str" or tag == _TAG + "timestamp":  # quoted, or `!!str`; a date stays text
            return node.value
        # Plain scalars (resolved by _Loader) and explicit `!!int`/`!!float`/`!!bool`/`!!null`: the YAML 1.2
        # core value, so `!!int 010` is 10 and not PyYAML's 8 (and is reported as ambiguous, like `010`).
        problem = ambiguity(node.value)
        value = core_scalar(node.value)
        if problem is not None:
            self.doc.problems.append(SourceError(AMBIGUOUS_SCALAR, *problem, self.pos(node)))
            return value
        kind = tag.rsplit(":", 1)[-1]
        if kind == "float" and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if {"null": value is None, "bool": isinstance(value, bool), "float": isinstance(value, float),
                "int": isinstance(value, int) and not isinstance(value, bool)}[kind]:
            return value
        raise SourceError(UNSAFE_TAG, f"{node.value!r} is not a valid {kind}", "remove the tag", self.pos(node))
