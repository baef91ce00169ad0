"""did_you_mean(): the closest valid name for a typo, shared by the schema and style rules."""

from __future__ import annotations

from typing import Iterable, Optional


def did_you_mean(word: str, choices: Iterable[str]) -> Optional[str]:
    import difflib

    choices = list(choices)
    found = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not found:
        lowered = {c.lower(): c for c in choices}
        found = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
        found = [lowered[f] for f in found]
    return found[0] if found else None
