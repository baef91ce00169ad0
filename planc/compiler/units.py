"""Byte counts as text: every size the compiler prints (accounting warnings, checks, memory budget, explain)."""

from __future__ import annotations


def human_bytes(n: float, digits: int = 2) -> str:
    """`1536` -> `1.50 KiB` (whole bytes below 1 KiB; `digits` decimals above)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return f"{n:.{digits}f} TiB"
