"""The stream-K schedule of the decode kernels (`KernelConfig.stream_k`): a fixed grid of programs shares the
flattened iteration space of a GEMM evenly and contiguously, so every program reads the same bytes (+-1 K step) and
all finish together: no ragged last wave, which a split over powers of two leaves (V4 at 1 token: L2's 1344 split
programs on 660 resident slots run a third wave of 24 alone).

The space: each output tile's `steps` 64-deep K steps cut into `slices` runs of `run = steps / slices` steps, the
runs ordered slice-major (all tiles' first runs, then all second runs, ...; `slices` 1: tile by tile), so programs
running at the same time read neighbouring tiles at the same K steps, as the split grid's do. A run is a tile of the
schedule ("piece"): `total` steps over `programs`, program p covers steps [`span`(p)), the first `total % programs`
programs one step more than the others; the programs that cover part of a piece are consecutive
(`tile_contributors`). A program goes segment by segment (one per piece it touches, `max_segments` at most), storing
each segment's FP32 partial in its own workspace slot `partial_slot` (the segment's index in the program), except a
whole output tile (`slices` 1), whose epilogue runs at once. An output tile's last arrival (of all its pieces'
contributors) sums the partials in schedule order (slice, then program: the same bits on every run).

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


def partial_slot(program: int, piece: int, run: int, total: int, programs: int) -> int:
    """Where `program` stores its partial of schedule tile `piece` (of `run` steps): the index of that segment
    among the program's segments."""
    return piece - span(program, total, programs)[0] // run


def max_segments(total: int, programs: int, run: int) -> int:
    """The most segments (schedule tiles touched) of any program's span, for this or any smaller `total`."""
    longest = -(-total // programs)
    return max(1, (longest + run - 2) // run + 1)


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
