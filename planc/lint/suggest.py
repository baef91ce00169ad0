"""did_you_mean(): the closest valid name for a typo, the one did-you-mean of planc (keys, styles, rule codes,
model types, plan file names).

A name is suggested only when it is what a human would call a typo of the word: the same name up to case and
`-`/`_`, or an edit distance (insertions, deletions, substitutions, swaps of two neighbours) of at most a third
of the word's length (at least 1), the cutoff rustc uses for its suggestions; or, for a word of several
`_`-separated words, a name that has them all in order with some left out (`num_layers`: `num_hidden_layers`). A ratio of common characters, as
difflib computes it, calls `big` close to `binary` and `my_plan.yaml` close to `llama4.yaml` (the suffix they
share counts); an edit distance does not.
"""

from __future__ import annotations

from typing import Iterable, Optional


def _normal(word: str) -> str:
    """The spelling that case and `-`/`_` do not change: `deepseek-v3` and `DeepSeek_V3` are one name."""
    return word.casefold().replace("-", "_")


def edit_distance(a: str, b: str) -> int:
    """Optimal string alignment distance: insertions, deletions, substitutions and swaps of two neighbours."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def _words_left_out(word: str, name: str) -> bool:
    """`name` is `word` with words added: the `_`-separated words of `word` (two or more) are words of `name`, in
    order."""
    words, rest = word.split("_"), iter(name.split("_"))
    return len(words) > 1 and all(w in rest for w in words)


def max_distance(word: str) -> int:
    """The most edits a typo of `word` has: a third of its length, at least 1."""
    return max(len(word), 3) // 3


def close_matches(word: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """Up to `n` of `choices` that `word` may be a typo of, closest first (ties keep the order of `choices`)."""
    key = _normal(word)
    limit = max_distance(key)
    scored = []
    for index, choice in enumerate(dict.fromkeys(choices)):
        other = _normal(choice)
        d = edit_distance(key, other) if abs(len(other) - len(key)) <= limit else limit + 1
        if d <= limit or _words_left_out(key, other):
            scored.append((d, index, choice))
    return [choice for *_, choice in sorted(scored)[:n]]


def did_you_mean(word: str, choices: Iterable[str]) -> Optional[str]:
    """The one choice `word` is most likely a typo of, or None when none is close enough to say so."""
    found = close_matches(word, choices, n=1)
    return found[0] if found else None
