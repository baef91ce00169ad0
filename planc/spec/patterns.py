"""Path patterns of plan rules: dot-separated segments, `*` for any one segment, `{a,b}` alternatives.

A pattern is expanded once into concrete alternatives (`self_attn.{q,k}_proj` -> two alternatives),
each a tuple of segments where `*` is a wildcard; matching a module path is then a per-segment
comparison. Only whole-segment wildcards exist, so a pattern can never match "half" a name.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from functools import cached_property

from planc.errors import PlancError

_SEGMENT_CHAR = r"[A-Za-z0-9_*{},\-]"  # module-name characters plus the pattern syntax
_SEGMENT_OK = re.compile(f"{_SEGMENT_CHAR}+")

# The pattern grammar as one regular expression (ECMAScript and Python alike): the JSON Schema gives it to
# editors for rule-table keys. It accepts exactly the patterns `Pattern` parses, up to the alternatives cap.
_NAME = r"[A-Za-z0-9_\-]+"
_SEGMENT = rf"(\*|({_NAME}|\{{{_NAME}(,{_NAME})*\}})+)"
PATTERN_REGEX = rf"^{_SEGMENT}(\.{_SEGMENT})*$"
PATTERN_SYNTAX = (
    "A module or parameter path: dot-separated segments, `*` a whole segment (any name), `{a,b}` alternatives "
    "inside a segment (`self_attn.{q,k,v}_proj`). No other glob or regex syntax."
)

# A real rule lists a handful of alternatives (`{q,k,v}_proj`); brace groups multiply, so 22 groups
# of two would be 4 million. The count is computed before anything is expanded, so a hostile plan
# costs parsing time only (lint, compile and apply all go through Pattern).
MAX_ALTERNATIVES = 256


class PatternError(PlancError, ValueError):
    """A pattern that can never match anything (empty segment, bad braces, stray characters)."""

    def __init__(self, pattern: str, problem: str, hint: str):
        super().__init__(f"pattern {pattern!r}: {problem}")
        self.pattern = pattern
        self.problem = problem
        self.hint = hint


def _segment_parts(pattern: str, segment: str) -> list[list[str]]:
    """The brace groups of one segment, unexpanded: `{q,k}_proj` -> [[`q`, `k`], [`_proj`]]."""
    parts: list[list[str]] = []
    i = 0
    while i < len(segment):
        c = segment[i]
        if c == "{":
            close = segment.find("}", i)
            if close < 0:
                raise PatternError(pattern, f"unclosed '{{' in segment {segment!r}", "close the group: `{a,b}`")
            body = segment[i + 1 : close]
            if "{" in body:
                raise PatternError(pattern, f"nested braces in segment {segment!r}", "flatten to one `{a,b,c}` group")
            options = body.split(",")
            if any(o == "" for o in options):
                raise PatternError(
                    pattern, f"empty alternative in {{{body}}}", "list non-empty alternatives: `{a,b}`"
                )
            if any("*" in o for o in options):
                raise PatternError(pattern, "'*' inside braces", "use '*' as a whole segment instead")
            parts.append(options)
            i = close + 1
        elif c == "}":
            raise PatternError(pattern, f"unmatched '}}' in segment {segment!r}", "open the group with '{'")
        elif c == ",":
            raise PatternError(pattern, f"',' outside braces in segment {segment!r}", "write alternatives as `{a,b}`")
        else:
            j = i
            while j < len(segment) and segment[j] not in "{},":
                j += 1
            parts.append([segment[i:j]])
            i = j
    return parts


@dataclass(frozen=True)
class Pattern:
    """A rule's path pattern, parsed and validated on construction."""

    text: str

    def __post_init__(self) -> None:
        self.alternatives  # noqa: B018 - validate eagerly

    @cached_property
    def alternatives(self) -> tuple[tuple[str, ...], ...]:
        text = self.text
        if not text or text.strip() != text:
            raise PatternError(text, "empty pattern or surrounding whitespace", "write a path like `model.layers.*.mlp`")
        segments = _split_top_level(text)
        parsed: list[list[list[str]]] = []
        for seg in segments:
            if seg == "":
                raise PatternError(text, "empty path segment (`..`, or a leading/trailing dot)", "remove the extra dot")
            if not _SEGMENT_OK.fullmatch(seg):  # fullmatch: `^...$` would let a trailing newline through
                bad = sorted({c for c in seg if not re.fullmatch(_SEGMENT_CHAR, c)})
                shown = " ".join(c if c.isprintable() and not c.isspace() else repr(c) for c in bad)
                raise PatternError(
                    text,
                    f"segment {seg!r} has characters no module path contains: {shown}",
                    "patterns are not globs or regexes: use '*' for a whole segment and {a,b} for alternatives",
                )
            if "*" in seg and seg != "*":
                raise PatternError(text, f"'*' must be a whole segment, got {seg!r}", "use `*` alone between dots")
            parsed.append(_segment_parts(text, seg))
        count = math.prod(len(options) for parts in parsed for options in parts)
        if count > MAX_ALTERNATIVES:
            raise PatternError(
                text,
                f"its brace groups expand to {count} alternatives (at most {MAX_ALTERNATIVES})",
                "split it into a few rules, or use `*` for a segment whose names do not matter",
            )
        expanded = [["".join(p) for p in itertools.product(*parts)] for parts in parsed]
        return tuple(tuple(alt) for alt in itertools.product(*expanded))

    def matches(self, path: str) -> bool:
        segs = path.split(".")
        return any(_match(alt, segs) for alt in self.alternatives)

    def __str__(self) -> str:
        return self.text


def _split_top_level(text: str) -> list[str]:
    """Split on dots that are not inside braces (`{a.b}` is rejected later as a bad segment)."""
    out: list[str] = []
    cur: list[str] = []
    depth = 0
    for c in text:
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        if c == "." and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    out.append("".join(cur))
    return out


def _match(alt: tuple[str, ...], segs: list[str]) -> bool:
    return len(alt) == len(segs) and all(a == "*" or a == s for a, s in zip(alt, segs))


def try_pattern(text: str) -> Pattern | PatternError:
    """Parse without raising: the linter reports the error, the compiler raises it."""
    try:
        return Pattern(text)
    except PatternError as e:
        return e
