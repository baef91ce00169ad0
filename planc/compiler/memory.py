"""The memory budget: what each rank reads from a checkpoint and holds afterwards, against its device.

`planc explain PLAN --device-memory 141GiB` (and `planc.load`, which knows its device) refuses a plan
whose per-rank shard cannot fit before a byte is read: PLC660, with the numbers and what would fit
(more ranks only shrink the sharded part; FP8 weights halve bf16 ones). Pure Python: the compiled
plan already holds the bytes per rank by dtype; the per-parameter split comes from
`shard_divisor`, the same rule the compiler's own accounting uses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional

from planc.compiler.compiled import CompiledPlan, CompileProblem
from planc.lint.diagnostic import Diagnostic
from planc.compiler.units import human_bytes
from planc.lint.registry import compile_rule


DEVICE_MEMORY = compile_rule(
    "PLC660", "shard-exceeds-device-memory", "a rank's parameters, or its workload's peak, exceed the device memory",
    "A device memory budget comes from `planc explain --device-memory` (a card such as `H100`, or a size: `80GiB` "
    "binary, `80GB` decimal) or from `planc.load`, which reads its device's. Two checks use it. (1) The parameters "
    "each rank holds once loaded (its TP/EP shard: the sharded part plus the replicated part; under "
    "`data_parallel: fsdp` this is the loading moment, before FSDP shards them over dp) must fit; the hint names "
    "the ranks, or the FP8 weights, that would fit. (2) `planc explain` only, with a workload (`--train` or "
    "`--serve` with `--batch`/`--seq`): the workload's peak per rank (parameters, gradients and AdamW state "
    "when training, the activations kept for backward or the KV cache, the largest transient) plus the reserve "
    "outside PyTorch's allocator (`--reserve`, 2 GiB by default) must fit; the hint names the largest "
    "micro-batch (or, with `--seq auto`, sequence) that fits, else what the plan and flags do not already use "
    "(more ranks, fsdp, activation checkpointing, a shorter sequence, FP8 weights when serving). It needs a "
    "model and a budget, so its examples are commands, not plans: `planc explain plans/deepseek_v3.yaml "
    "--device-memory H200` fails (158.11 GiB per rank at tp_size 8), `--device-memory 200GiB` passes; "
    "`planc explain plans/mixtral.yaml --train --batch 1 --seq 4096 --device-memory H100` prices the peak "
    "(docs/memory.md).",
)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """`141GiB`, `80GB`, `1.5 TiB`, `1024` (bytes) -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size: write e.g. 141GiB, 80GB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class Budget:
    """Bytes per rank by dtype: held after loading, and read from the checkpoint (when one is given)."""

    hold: tuple[tuple[str, int], ...]
    read: Optional[tuple[tuple[str, int], ...]] = None
    device_memory: Optional[int] = None
    device_read: Optional[str] = None  # how --device-memory was read (planc.compiler.devices)

    @property
    def hold_total(self) -> int:
        return sum(n for _, n in self.hold)

    def render(self) -> str:
        def line(label: str, items: Iterable[tuple[str, int]]) -> str:
            parts = ", ".join(f"{dtype} {human_bytes(n, 1)}" for dtype, n in items)
            return f"  {label}: {human_bytes(sum(n for _, n in items), 2)} per rank ({parts})"

        lines = ["memory:"]
        if self.read is not None:
            lines.append(line("read from the checkpoint", self.read))
        lines.append(line("held after loading", self.hold))
        if self.device_memory is not None:
            left = self.device_memory - self.hold_total
            lines.append(
                f"  device memory: {human_bytes(self.device_memory, 1)}; "
                + (f"{human_bytes(left, 1)} left for activations and caches" if left >= 0 else
                   f"OVER by {human_bytes(-left, 1)}")
            )
            if self.device_read:
                lines.append(f"    ({self.device_read})")
        return "\n".join(lines)


def read_per_rank(compiled: CompiledPlan, reads: Iterable[tuple[str, str, tuple[int, ...], int]]) -> tuple[tuple[str, int], ...]:
    """Bytes per rank by checkpoint dtype, from `(model parameter, checkpoint dtype, parameter shape, bytes)`."""
    from planc.compiler.accounting import shard_divisor

    styles = {a.fqn: a.style for a in compiled.assignments if a.target == "parameter"}
    p = compiled.parallel
    out: dict[str, int] = {}
    for fqn, dtype, shape, nbytes in reads:
        div = shard_divisor(styles.get(fqn), shape, p.tp_size, p.ep_size)
        out[dtype] = out.get(dtype, 0) + -(-nbytes // div)
    return tuple(sorted(out.items(), key=lambda kv: -kv[1]))


def budget(
    compiled: CompiledPlan, device_memory: Optional[int] = None, read: Optional[tuple[tuple[str, int], ...]] = None,
    device_read: Optional[str] = None,
) -> Budget:
    return Budget(compiled.bytes_per_rank_by_dtype, read, device_memory, device_read)


def budget_problems(compiled: CompiledPlan, device_memory: int, where: str, train: bool = False) -> list[Diagnostic]:
    """PLC660 when this rank's parameters alone exceed `device_memory`, with what would fit
    (planc.compiler.memory_hints; `train`: the weights will be trained, so FP8 weights are no way out)."""
    from planc.compiler.memory_hints import Situation, hint_line, load_note

    need = compiled.bytes_per_rank
    if need <= device_memory:
        return []
    p = compiled.parallel
    sharded, replicated = compiled.bytes_sharded_per_rank, compiled.bytes_replicated_per_rank
    return [CompileProblem(
        code=DEVICE_MEMORY,
        message=(
            f"each rank holds {human_bytes(need, 2)} of parameters under this plan "
            f"(tp_size={p.tp_size}, ep_size={p.ep_size}; {human_bytes(sharded, 1)} sharded + "
            f"{human_bytes(replicated, 1)} replicated), more than the {human_bytes(device_memory, 1)} of device memory"
            + load_note(compiled)
        ),
        module=None,
        where=where,
        hint=hint_line(Situation(compiled, None, static=need, room=device_memory, train_flag=train)),
    )]


__all__ = ["DEVICE_MEMORY", "Budget", "budget", "budget_problems", "parse_size", "read_per_rank"]
