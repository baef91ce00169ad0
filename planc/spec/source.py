"""Safe YAML with source positions.

Parsed with `yaml.compose` on the SafeLoader (no tag builds a Python object), then converted to plain
values while recording the position of every key and value, so every diagnostic can say
`file:line:col`. Hardening (duplicate keys, alias/size caps, tabs, encodings) lives here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import yaml


@dataclass(frozen=True)
class Position:
    path: Optional[str]
    line: int  # 1-based
    col: int  # 1-based

    def __str__(self) -> str:
        return f"{self.path or '<string>'}:{self.line}:{self.col}"


KeyPath = tuple  # e.g. ("experts", "ep_implementation") or ("tp_plan", "model.layers.*.q_proj")


@dataclass
class SourceDoc:
    """Plain data of one YAML document plus the positions of its keys and values."""

    data: Any
    path: Optional[str]
    text: str
    key_positions: dict = field(default_factory=dict)  # KeyPath -> Position of the key
    value_positions: dict = field(default_factory=dict)  # KeyPath -> Position of the value

    def key_position(self, keypath: KeyPath) -> Optional[Position]:
        return self.key_positions.get(tuple(keypath))

    def value_position(self, keypath: KeyPath) -> Optional[Position]:
        return self.value_positions.get(tuple(keypath))

    def position(self, keypath: KeyPath) -> Optional[Position]:
        """Best position for a key path: the key itself, else the nearest enclosing key."""
        keypath = tuple(keypath)
        while keypath:
            pos = self.key_positions.get(keypath)
            if pos is not None:
                return pos
            keypath = keypath[:-1]
        return Position(self.path, 1, 1)


class SourceError(Exception):
    """YAML that cannot become a plan document: carries a position, a message, a hint and a code."""

    def __init__(self, code: str, message: str, hint: str, position: Position):
        super().__init__(f"{position}: {message}")
        self.code = code
        self.message = message
        self.hint = hint
        self.position = position


def _pos(path: Optional[str], mark) -> Position:
    return Position(path, mark.line + 1, mark.column + 1)


def parse_yaml(text: str, path: Optional[str] = None) -> SourceDoc:
    """Parse one YAML document into a SourceDoc; raises SourceError for anything that is not plain data."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        pos = _pos(path, mark) if mark else Position(path, 1, 1)
        raise SourceError("PLC001", f"invalid YAML: {e.problem or e}", "fix the YAML syntax at this position", pos) from None
    except yaml.YAMLError as e:
        raise SourceError("PLC001", f"invalid YAML: {e}", "fix the YAML syntax", Position(path, 1, 1)) from None
    doc = SourceDoc(data=None, path=path, text=text)
    if node is None:
        doc.data = None
        return doc
    doc.data = _convert(node, (), doc)
    return doc


def _convert(node, keypath: tuple, doc: SourceDoc):
    doc.value_positions.setdefault(keypath, _pos(doc.path, node.start_mark))
    if isinstance(node, yaml.MappingNode):
        out = {}
        for key_node, value_node in node.value:
            key = _convert_scalar(key_node, doc) if isinstance(key_node, yaml.ScalarNode) else None
            if key is None or isinstance(key, (list, dict)):
                raise SourceError(
                    "PLC001", "mapping keys must be plain scalars", "write the key as a string", _pos(doc.path, key_node.start_mark)
                )
            kp = keypath + (key,)
            doc.key_positions[kp] = _pos(doc.path, key_node.start_mark)
            out[key] = _convert(value_node, kp, doc)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_convert(child, keypath + (i,), doc) for i, child in enumerate(node.value)]
    return _convert_scalar(node, doc)


def _construct(node):
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


def _convert_scalar(node, doc: SourceDoc):
    try:
        return _construct(node)
    except yaml.constructor.ConstructorError as e:
        raise SourceError(
            "PLC001",
            f"unsupported YAML tag {node.tag!r}: plans hold plain data only",
            "remove the tag; nothing in a plan is executed or constructed",
            _pos(doc.path, node.start_mark),
        ) from None
