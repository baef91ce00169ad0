"""Safe YAML with source positions.

A plan file is untrusted input (pre-commit runs the linter on whatever is staged), so this module
turns bytes into plain data without ever building a Python object from a tag, without expanding
aliases past a fixed budget, and with the `file:line:col` of every key and value kept for the
diagnostics. Problems that stop parsing raise `SourceError`; problems that do not (a key written
twice) are collected in `SourceDoc.problems` so the linter can report them next to everything else.

The codes used here are documented by the `source` rule family in `planc.lint.rules_source`.
"""

from __future__ import annotations

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

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: 10x faster, caps nesting in C

_TAG = "tag:yaml.org,2002:"
_PLAIN_TAGS = {_TAG + t for t in ("str", "int", "float", "bool", "null", "timestamp")}


@dataclass(frozen=True)
class Position:
    path: Optional[str]
    line: int  # 1-based
    col: int  # 1-based

    def __str__(self) -> str:
        return f"{self.path or '<string>'}:{self.line}:{self.col}"


KeyPath = tuple  # e.g. ("experts", "ep_implementation") or ("tp_plan", "model.layers.*.q_proj")


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
    key_positions: dict = field(default_factory=dict)  # KeyPath -> Position of the key
    value_positions: dict = field(default_factory=dict)  # KeyPath -> Position of the value
    problems: list = field(default_factory=list)  # non-fatal SourceErrors (duplicate keys)

    def key_position(self, keypath: KeyPath) -> Optional[Position]:
        return self.key_positions.get(tuple(keypath))

    def value_position(self, keypath: KeyPath) -> Optional[Position]:
        return self.value_positions.get(tuple(keypath))

    def position(self, keypath: KeyPath) -> Optional[Position]:
        """Best position for a key path: the key itself, else the nearest enclosing key."""
        return nearest_key_position(self.key_positions, keypath, self.path)


def nearest_key_position(key_positions: dict, keypath: KeyPath, path: Optional[str]) -> Position:
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
    return SourceError(YAML_SYNTAX, f"invalid YAML: {problem}{context}", "fix the YAML syntax at this position", pos)


class _Converter:
    """Nodes -> plain dict/list/scalars with positions, alias expansion bounded by a node budget."""

    def __init__(self, doc: SourceDoc):
        self.doc = doc
        self.nodes = 0
        self.chars = 0
        self.active: set[int] = set()  # ids of collections being converted (a recursive alias loops)
        self._scalars = yaml.constructor.SafeConstructor()

    def pos(self, node) -> Position:
        return Position(self.doc.path, node.start_mark.line + 1, node.start_mark.column + 1)

    def convert(self, node, keypath: tuple, depth: int):
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

    def mapping(self, node, keypath: tuple, depth: int) -> dict:
        out: dict = {}
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

    def check_tag(self, node, kind: str) -> None:
        if node.tag != _TAG + kind:
            raise self.tag_error(node)

    def tag_error(self, node) -> SourceError:
        return SourceError(
            UNSAFE_TAG,
            f"YAML tag {node.tag!r} is not allowed: plans hold plain strings, numbers, mappings and lists",
            "remove the tag; nothing in a plan is constructed or executed",
            self.pos(node),
        )

    def scalar(self, node):
        tag = node.tag
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
        if tag == _TAG + "str" or tag == _TAG + "timestamp":  # a date stays text: no datetime objects
            return node.value
        if tag == _TAG + "null":
            return None
        if tag == _TAG + "bool":
            return self._scalars.construct_yaml_bool(node)
        try:
            if tag == _TAG + "int":
                return self._scalars.construct_yaml_int(node)
            return self._scalars.construct_yaml_float(node)
        except (ValueError, yaml.constructor.ConstructorError):  # `!!int abc`
            raise SourceError(
                UNSAFE_TAG, f"{node.value!r} is not a valid {tag.rsplit(':', 1)[-1]}", "remove the tag", self.pos(node)
            ) from None
