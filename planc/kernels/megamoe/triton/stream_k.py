"""The stream-K schedule of the decode kernels (`KernelConfig.stream_k`): a fixed grid of programs shares the
flattened iteration space (output tile, 64-deep K step) evenly and contiguously, so every program reads the same
bytes (+-1 K step) and all finish together: no ragged last wave, which a split over powers of two leaves (V4 at 1
token: L2's 1344 split programs on 660 resident slots run a third wave of 24 alone).

`total` steps (tiles x `steps` K steps per tile, the tiles in row-major order) over `programs`: program p covers
steps [`span`(p)); the first `total % programs` programs one step more than the others. A tile's contributors are
consecutive programs (`tile_contributors`); each stores the FP32 partial of its part of the tile in its own
workspace slot, `partial_slot`: 0 where that part is the program's first segment, 1 where it is its last (a program
covers a part of at most two tiles: the ones it starts and ends in; the tiles between, it covers whole). The last
contributor to arrive sums the partials in contributor order (the same bits on every run).

The same arithmetic twice: in Python here (the host's workspace sizing and the tests' brute-force check) and in
Triton below (`_span`, `_owner`, `_contributors`, what the kernels run); a test runs the latter against the former.
"""

from __future__ import annotations

from planc.kernels.megamoe.triton.target import tl, triton


def span(program: int, total: int, programs: int) -> tuple[int, int]:
    """Steps [start, end) of `program`: `total // programs` each, one more for the first `total % programs`."""
    q, r = divmod(total, programs)
    start = program * q + min(program, r)
    return start, start + q + (program < r)


def owner(step: int, total: int, programs: int) -> int:
    """The program whose span holds `step` (< `total`)."""
    q, r = divmod(total, programs)
    wide = r * (q + 1)  # the steps of the first r programs, q + 1 each
    return step // (q + 1) if step < wide else r + (step - wide) // q


def tile_contributors(tile: int, steps: int, total: int, programs: int) -> tuple[int, int]:
    """(first program, how many) of the programs that cover a part of `tile`'s `steps` K steps."""
    first = owner(tile * steps, total, programs)
    return first, owner(tile * steps + steps - 1, total, programs) - first + 1


def partial_slot(program: int, tile: int, steps: int, total: int, programs: int) -> int:
    """Where `program` stores its partial of `tile`: 0 if its span starts in the tile (its first segment), else 1."""
    return 0 if span(program, total, programs)[0] >= tile * steps else 1


if triton is not None:

    @triton.jit
    def _span(pid, total, programs):
        """`span` in Triton."""
        q = total // programs
        r = total % programs
        start = pid * q + tl.minimum(pid, r)
        return start, start + q + (pid < r).to(tl.int32)

    @triton.jit
    def _owner(step, total, programs):
        """`owner` in Triton (q may be 0 where programs > total: then every step is in the first branch)."""
        q = total // programs
        r = total % programs
        wide = r * (q + 1)
        return tl.where(step < wide, step // (q + 1), r + (step - wide) // tl.maximum(q, 1))

    @triton.jit
    def _contributors(tile, steps, total, programs):
        """`tile_contributors` in Triton."""
        first = _owner(tile * steps, total, programs)
        return first, _owner(tile * steps + steps - 1, total, programs) - first + 1
