"""What to suggest when memory does not fit: one table of hint rules, each reading what the plan and the flags set.

A hint never suggests what the plan already has (`activation_checkpointing: full`, `data_parallel: fsdp`), what
cannot help (a shorter sequence when the parameters, gradients and AdamW state alone exceed the device), or a
training setting for `--serve`. The PLC660 lines of `planc explain` (the parameters held while loading, and the
workload's peak) and the notes under the training table all take their words from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from planc.compiler.compiled import CompiledPlan
from planc.compiler.optimizer_step import OPTIMIZER_STEP
from planc.compiler.units import human_bytes

WIDE_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Situation:
    """What the hints read: the plan's settings, the flags given, and the bytes per rank against the device.

    `workload`: "train", "serve", or None (the parameters held after loading, no workload priced). `static`: the
    bytes per rank no batch or sequence changes (parameters, plus gradients and AdamW state when training);
    `room`: what the device leaves for them. `train_flag`: `--train` was given (the weights will be trained).
    `moment`, `adamw_step`: the peak's moment and the AdamW step it priced."""

    compiled: CompiledPlan
    workload: Optional[str]
    static: int
    room: int
    batch: int = 1
    train_flag: bool = False
    moment: Optional[str] = None  # the peak's moment (planc.compiler.peak_memory), when a workload was priced
    adamw_step: Optional[str] = None  # the AdamW step priced (planc.compiler.optimizer_step.STEPS)

    @property
    def training(self) -> bool:
        return self.workload == "train"

    @property
    def fsdp(self) -> bool:
        return self.compiled.data_parallel_mode.shards_parameters

    @property
    def recomputes(self) -> bool:
        t = self.compiled.training
        return t is not None and t.activation_checkpointing_row.recomputes_layers

    @property
    def workload_can_shrink(self) -> bool:
        """Whether a smaller batch or sequence can make it fit: the static part alone leaves room."""
        return self.workload is not None and self.static < self.room

    @property
    def wide(self) -> int:
        return sum(n for dtype, n in self.compiled.bytes_per_rank_by_dtype if dtype in WIDE_DTYPES)


def _more_ranks(s: Situation) -> str:
    p = s.compiled.parallel
    sharded, replicated = s.compiled.bytes_sharded_per_rank, s.compiled.bytes_replicated_per_rank
    if s.workload is None and replicated < s.room:
        factor = -(-sharded // max(s.room - replicated, 1))
        return (f"about {factor}x the ranks for the sharded part (e.g. tp_size/ep_size {p.tp_size * factor}/"
                f"{p.ep_size * factor}; the {human_bytes(replicated, 1)} replicated per rank does not shrink)")
    return f"more ranks (a larger tp_size/ep_size than {p.tp_size}/{p.ep_size})"


def _fused_step(s: Situation) -> str:
    return (f"the fused AdamW step (`torch.optim.AdamW(params, fused=True)`, priced with --optimizer fused): the "
            f"{s.adamw_step} step's temporaries set this peak, the fused step holds none")


def _fp8(s: Situation) -> str:
    need = s.compiled.bytes_per_rank
    return (f"a checkpoint with FP8 weights (`quantization_config: fp8`): its 16-bit weights take half the bytes, "
            f"about {human_bytes(need - s.wide // 2, 1)} per rank instead of {human_bytes(need, 1)}")


@dataclass(frozen=True)
class HintRule:
    """One suggestion and when it can help."""

    name: str
    applies: Callable[[Situation], bool]
    text: Callable[[Situation], str]


HINT_RULES: tuple[HintRule, ...] = (
    HintRule("more-ranks", lambda s: s.workload is None or s.compiled.bytes_sharded_per_rank > 0, _more_ranks),
    # the peak is the optimizer step itself: the step torch takes by default holds temporaries, the fused one none
    HintRule("fused-adamw", lambda s: s.training and s.moment == OPTIMIZER_STEP and s.adamw_step != "fused",
             _fused_step),
    HintRule("fsdp", lambda s: s.training and not s.fsdp,
             lambda s: "`training: {data_parallel: fsdp}` (parameters, gradients and AdamW state sharded over dp)"),
    HintRule("more-dp", lambda s: s.training and s.fsdp,
             lambda s: f"a larger dp_size than {s.compiled.parallel.dp_size} (fsdp shards parameters, gradients "
                       "and AdamW state over it)"),
    HintRule("activation-checkpointing", lambda s: s.training and not s.recomputes and s.workload_can_shrink,
             lambda s: "`training: {activation_checkpointing: full}`"),
    HintRule("shorter-seq", lambda s: s.workload_can_shrink,
             lambda s: "a shorter --seq" + (" or a smaller --batch" if s.batch > 1 else "")),
    HintRule("fp8", lambda s: not (s.training or s.train_flag) and s.wide > 0, _fp8),
)


def hints(s: Situation) -> list[str]:
    """The suggestions that apply, in table order."""
    return [rule.text(s) for rule in HINT_RULES if rule.applies(s)]


def hint_line(s: Situation) -> str:
    """`use A, or B.` (what PLC660's hint says); a device with more memory when nothing else applies."""
    found = hints(s)
    return ("use " + ", or ".join(found) + ".") if found else "use a device with more memory."


def peak_hint(s: Situation, max_batch: Optional[int], max_seq: Optional[int]) -> str:
    """The hint under a workload peak that does not fit: the largest workload that fits when one does, else why
    none does and what can help."""
    if max_batch:
        return f"the largest micro-batch that fits is {max_batch}"
    if max_seq:
        return f"the longest sequence that fits is {max_seq}"
    if s.workload_can_shrink:
        return "not even one sequence fits: " + hint_line(s)
    what = "parameters, gradients and AdamW state" if s.training else "parameters"
    return (f"not even one sequence fits: the {what} alone take {human_bytes(s.static, 2)} per rank, more than the "
            f"{human_bytes(s.room, 2)} the device leaves after the reserve; " + hint_line(s))


def load_note(compiled: CompiledPlan) -> str:
    """When the parameters-held check applies: before FSDP shards them (what the training table prices after)."""
    if not compiled.data_parallel_mode.shards_parameters:
        return ""
    return (f"; this is while loading, before fsdp shards them over dp_size={compiled.parallel.dp_size} (planc.load "
            "and planc.apply hold each rank's TP/EP shard first); the training table below counts them after")


def activations_note(workload_given: bool) -> Optional[str]:
    """The note under the training table when no workload was priced; None when --batch/--seq were given."""
    if workload_given:
        return None
    return "  activations are not counted here: add --batch B --seq S for the peak per rank"
