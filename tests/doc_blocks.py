"""The fenced blocks of the README and docs/, each with the HTML comments right above it, and how each is run.

A reader copies these blocks, so each one either runs in the tests or says in the page why it does not. The
comment lines right above a fence are its markers:

- `<!-- runnable: NAME -->`: run as pasted by tests/test_docs.py's runner NAME.
- `<!-- lint: clean -->` / `<!-- lint: PLCnnn -->`: a plan linted by `planc lint`, clean or reporting that code
  (a YAML block without a marker is a plan that must lint clean).
- `<!-- runs in: tests/PATH.py -->`: another test reads the block from the page and runs it (the file must name
  the page); the marker under it names the block for that test.
- `<!-- not run: REASON -->`: it needs what a CPU box in CI has not (a GPU, a download, the network, hours);
  the reason says what, and the test prints it.

Unmarked `bash` and `console` blocks made of `planc` command lines run in a copy of the clone (tests/test_docs.py),
a `console` block's shown output checked against what the command prints. Blocks without a language or in `text`
are pictures (diagrams, sample output, signatures) and hold no `$ ` command line. docs/lint.md's generated rule
section holds each rule's failing and passing example, run by tests/lint/test_rules.py and
tests/compiler/test_rule_examples.py from the registry the section is generated from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- ([\w .-]+?)(?:: (.*?))? -->$")
FENCE = re.compile(r"^```(\S*)\s*$")
RULES_SECTION = ("<!-- rules:begin", "<!-- rules:end -->")  # docs/lint.md's generated section (planc/lint/docs.py)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str  # "" when the fence names none
    text: str
    markers: tuple[tuple[str, str], ...]  # (kind, value) of each `<!-- kind: value -->` right above, top first
    generated: bool  # inside docs/lint.md's generated rule section

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    def marker(self, kind: str) -> str | None:
        return next((value for k, value in self.markers if k == kind), None)


def page_blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i, generated = 0, False
    while i < len(lines):
        line = lines[i]
        if line.startswith(RULES_SECTION[0]):
            generated = True
        elif line.startswith(RULES_SECTION[1]):
            generated = False
        fence = FENCE.match(line)
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        markers: list[tuple[str, str]] = []
        j = i - 1
        while j >= 0 and (m := MARKER.match(lines[j])):
            markers.insert(0, (m.group(1), m.group(2) or ""))
            j -= 1
        text = "".join(ln + "\n" for ln in lines[i + 1:end])
        out.append(Block(page, i + 1, fence.group(1), text, tuple(markers), generated))
        i = end + 1
    return out


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in page_blocks(page)]
