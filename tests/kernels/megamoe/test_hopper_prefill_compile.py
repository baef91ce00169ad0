"""The Hopper Gluon kernels (`hopper_prefill`) compiled for sm_90 here, without a GPU: Triton's own compiler and
ptxas, the installed Triton's Gluon API. What is checked is what a CPU can see: the kernels compile for the tuned
configs, the weight operand reaches the wgmma from registers without a shuffle (the kernels assert it: `_expand`'s
`convert_layout(..., assert_trivial=True)`), the PTX waits for each wgmma one step late (async; under a register cap
ptxas may wait at once instead, C7515), no register writes into a wgmma operand still in flight in the SASS, and no
register spills in the K loops (the cap spills a little outside them).
The numbers are checked on a GPU (`test_triton_gpu.py`: the same bits as the Triton kernels).

The compiler runs in a child process: this one may have defined planc's Triton functions for the CPU interpreter
(tests/conftest.py), which a compiled Gluon kernel cannot call."""

import json
import subprocess
import sys

import pytest

from planc.kernels.megamoe.triton import hopper_decode, hopper_prefill, hopper_prefill_ws
from tests.checkout_env import checkout_env
from tests.kernels.megamoe.common import GLUON, GLUON_80_ROWS

pytestmark = pytest.mark.skipif(hopper_prefill.gluon is None, reason="this Triton has no Gluon")

COMPILE = r'''
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from planc.kernels.megamoe.triton import hopper_decode, hopper_prefill, hopper_prefill_ws

def tma_types(rows, bn):
    """`hopper_prefill_ws.descriptors`' TMA descriptor types, as the launcher names them."""
    x, plain = hopper_prefill_ws.tma_layouts()
    return {"a_desc": f"tensordesc<bf16[64, 64],{x!r}>", "at_desc": f"tensordesc<bf16[{rows - 64}, 64],{x!r}>",
            "w_desc": f"tensordesc<i32[{bn // 16}, 128],{plain!r}>", "s_desc": f"tensordesc<i32[1, {bn // 2}],{plain!r}>"}

POINTER_TYPES = {"x_ptr": "*bf16", "a_ptr": "*bf16", "out_ptr": "*bf16", "weight_ptr": "*fp32"}  # others: *i32

def compile_sm90(kernel, maxnreg, descs=None, pointer_types=POINTER_TYPES, **constexprs):
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif descs and name in descs:
            signature[name] = descs[name]
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, "*i32")
        else:
            signature[name] = "fp32" if name == "clamp" else "i32"
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if name.endswith("_ptr") or name.startswith("stride") or name in ("hidden", "inter", "n_rows", "k_dim")}
    src = GluonASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    options = {"num_warps": constexprs["num_warps"], **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)

def cuobjdump(cubin, flag):
    """Triton's own cuobjdump run on a cubin (`-sass`: the instructions, `-res-usage`: registers and stack)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        return subprocess.run([tool, flag, path], capture_output=True, text=True, check=True).stdout

def sass(cubin):
    return cuobjdump(cubin, "-sass")

def loops(text, mma=True):
    """The instructions of each SASS loop that holds HGMMAs, QGMMAs or HMMAs (the K loops; mma=False: every loop):
    from a backward branch's target to it, conditional or (a loop whose test is at its top) unconditional within the
    kernel's body (an mbarrier wait's retry code, past an EXIT, jumps back into the loop unconditionally: not a
    loop)."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in text.splitlines()) if m]
    at = {a: i for i, (a, _) in enumerate(ins)}
    found = []
    for i, (_, t) in enumerate(ins):
        m = re.search(r"^(@!?U?P\w+\s+)?BRA\s.*?(0x[0-9a-f]+)", t)
        lo = at.get(int(m.group(2), 16)) if m else None
        if lo is not None and not m.group(1) and any(x.startswith("EXIT") for _, x in ins[lo:i + 1]):
            continue
        if lo is not None and lo < i and (not mma or any("GMMA" in x or "HMMA" in x for _, x in ins[lo:i + 1])):
            found.append([x for _, x in ins[lo:i + 1]])
    return found

def in_flight_writes(text):
    """Writes to the A-operand registers of a wgmma still in flight: a wgmma reads its registers until a
    WARPGROUP.DEPBAR retires its group, and ptxas reuses registers that PTX no longer uses. Each K loop is run
    through twice, tracking the HGMMA groups (each closed by a `gsb0` HGMMA) that `DEPBAR.LE gsb0, N` leaves in
    flight; the second pass (the loop's steady state) reports."""
    found = []
    for body in loops(text):
        groups, current = [], set()
        for lap in (0, 1):
            for x in body:
                mm = re.search(r"[HQ]GMMA\.\S+\s+R\d+,\s*R(\d+),", x)
                if mm:
                    current |= set(range(int(mm.group(1)), int(mm.group(1)) + 4))
                    if "gsb0" in x:
                        groups, current = groups + [current], set()
                    continue
                dep = re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)", x)
                if dep:
                    n = int(dep.group(1), 16)
                    groups = groups[max(len(groups) - n, 0):] if n else []
                    continue
                mm = re.match(r"(?:@!?U?P\w+\s+)?([A-Z][\w.]*)\s+R(\d+)\b", x)
                if (lap and mm and not mm.group(1).startswith(("ST", "WARPGROUP"))
                        and int(mm.group(2)) in set().union(current, *groups)):
                    found.append(x)
    return found

out = {}
for layer, rows, bn, warps, stages, maxnreg, large in json.loads(sys.argv[1]):
    common = dict(BN=bn, STAGES=stages, LARGE=large, ROWS=rows, num_warps=warps)
    if layer == "L1":
        kernel = compile_sm90(hopper_prefill.l1_kernel, maxnreg, HAS_CLAMP=True, **common)
    elif layer == "L2WS":
        kernel = compile_sm90(hopper_prefill_ws.l2_ws_kernel, maxnreg, tma_types(rows, bn), **common)
    elif layer in ("DL1", "DL2"):  # the warp-specialized decode kernels; `rows` is the K split here
        _, plain = hopper_prefill_ws.tma_layouts()
        descs = {"w_desc": f"tensordesc<i32[{bn // 16}, 128],{plain!r}>",
                 "s_desc": f"tensordesc<i32[1, {bn // 2}],{plain!r}>"}
        kernel = compile_sm90(hopper_decode.decode_ws_kernel, maxnreg, descs, dict(POINTER_TYPES, ws_ptr="*fp32"),
                              GATED=layer == "DL1", HAS_CLAMP=True, BT=16, BN=bn, SPLIT=rows, STAGES=stages,
                              LARGE=large, SYNC_MMA=maxnreg < 64, num_warps=warps)
    else:
        kernel = compile_sm90(hopper_prefill.l2_kernel, maxnreg, **common)
    ptx = kernel.asm["ptx"]
    text = sass(kernel.asm["cubin"])
    out[f"{layer}_{rows}_{bn}_{warps}_{stages}_{maxnreg}_{large}"] = dict(
        waits=sorted({int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx)}),
        mma64="wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in ptx,
        mma16="wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16" in ptx,
        staged_operand="stmatrix" in ptx or "st.shared.b16" in ptx,
        loop_spills=sum(bool(re.search(r"\b(LDL|STL)\b", x)) for body in loops(text) for x in body),
        full_waits=sum("DEPBAR.LE gsb0, 0x0" in x for body in loops(text) for x in body),
        hgmma_loops=bool(loops(text)),
        hmma_loops=any("HMMA" in x for body in loops(text) for x in body),
        in_flight_writes=in_flight_writes(text),
        # per K loop: cp.async waits, CTA barriers, proxy fences
        syncs=[[sum(bool(re.match(p, x)) for x in body) for p in (r"DEPBAR\.LE SB0", r"BAR\.SYNC", r"FENCE\.VIEW\.ASYNC")]
               for body in loops(text)],
        # the threads each CTA barrier in the K loops waits for; the register counts the partitions ask for
        barrier_threads=sorted({int(m.group(1), 16) for body in loops(text) for x in body
                                for m in [re.match(r"BAR\.SYNC\S*\s+0x[0-9a-f]+,\s*(0x[0-9a-f]+)", x)] if m}),
        setmaxnreg=sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);", ptx)}))
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def compiled():
    """The shipped config and the 80-row variant, both layers, both scale expansions, in one child process."""
    variants = [(layer, c.block_t, c.l1_n if layer == "L1" else c.l2_n, c.num_warps, c.num_stages, c.maxnreg, large)
                for c in (GLUON, GLUON_80_ROWS) for layer in ("L1", "L2") for large in (False, True)]
    variants += [("L2WS", c.block_t, c.l2_n, c.num_warps, c.num_stages, c.l2_maxnreg, large)
                 for c in (GLUON, GLUON_80_ROWS) for large in (False, True)]
    if hopper_decode.unavailable_reason is None:  # (layer, K split, BN, warps, stages, cap, large): V4 at 1 token
        variants += [(layer, split, 64, 4, stages, cap, large) for layer, split in (("DL1", 4), ("DL2", 2), ("DL1", 1))
                     for stages, cap in ((4, 64), (6, 48)) for large in (False, True)]  # 48: on mma.sync
    env = checkout_env()
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(variants)], capture_output=True, text=True,
                         env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_compiles_for_sm90_with_async_wgmma_and_no_spills_in_the_loops(compiled):
    assert len(compiled) == 12 + (12 if hopper_decode.unavailable_reason is None else 0)
    for name, got in compiled.items():
        if name.startswith(("L2WS", "DL")):
            continue  # below
        # The K loops (0, 1 or 2 tail MMAs per operand) wait with this tile's MMAs still in flight.
        rows = int(name.split("_")[1])
        assert set(range(1, 2 + (rows - 64) // 16)) <= set(got["waits"]), name
        assert got["mma64"] and got["mma16"], name
        assert not got["staged_operand"], name  # the weight operand never goes through shared memory
        assert got["loop_spills"] == 0, name  # the register cap may spill around the K loops, never in them
        # The next operand is expanded while the last MMAs run: never into registers those MMAs still read.
        assert got["hgmma_loops"] and got["in_flight_writes"] == [], (name, got["in_flight_writes"][:5])
        # One proxy fence per K tile and at most two barriers (the one after the cp.async wait, and in Triton < 3.9
        # the one its shared-memory analysis adds between the copies issued and the reads of another stage): a
        # fence before the issue got a second fence and a third barrier from the compiler (`_next_tile`).
        for waits, barriers, fences in got["syncs"]:
            assert waits >= 1 and fences == waits and barriers <= 2 * waits, (name, got["syncs"])
        if rows == 80:  # what the 80-row blocks are for: under the cap ptxas keeps every loop's wgmma in flight
            assert got["full_waits"] == 0, name


def test_warp_specialized_l2_keeps_its_mma_warps_to_expanding_and_multiplying(compiled):
    """`hopper_prefill_ws` under the shipped caps: waits one step late (ptxas keeps the 80-row loops async and
    serializes the 96-row ones at their 136 registers), no spills and no writes into a wgmma's operand in flight, and
    what the producer warp is for: no CTA-wide barrier in the K loops (only the MMA warpgroup's own 128 threads
    meet, before one of them frees a stage), no cp.async waits, and the producer's warpgroup gives its registers
    to the MMA warps (`setmaxnreg`)."""
    ws = {name: got for name, got in compiled.items() if name.startswith("L2WS")}
    assert len(ws) == 4
    for name, got in ws.items():
        rows = int(name.split("_")[1])
        assert set(range(1, 2 + (rows - 64) // 16)) <= set(got["waits"]), name
        assert got["mma64"] and got["mma16"] and not got["staged_operand"], name
        assert got["loop_spills"] == 0, name
        if rows == 80:  # at 104 registers ptxas keeps the 80-row loops' wgmma in flight (96 rows: serialized)
            assert got["full_waits"] == 0, name
        assert got["hgmma_loops"] and got["in_flight_writes"] == [], (name, got["in_flight_writes"][:5])
        assert got["barrier_threads"] == [128], (name, got["barrier_threads"])
        assert all(waits == 0 for waits, _, _ in got["syncs"]), (name, got["syncs"])
        assert hopper_prefill_ws.PRODUCER_REGS.value in got["setmaxnreg"], (name, got["setmaxnreg"])


@pytest.mark.skipif(hopper_decode.unavailable_reason is not None, reason=str(hopper_decode.unavailable_reason))
def test_warp_specialized_decode_kernels_leave_the_copies_to_the_producer(compiled):
    """`hopper_decode` (L1 gated, split in 4 and unsplit; L2 split in 2): at 64 registers (4 programs per SM) the
    16-column wgmma, at 48 (5 per SM) mma.sync, on the expanded weights from registers; no spills and no writes
    into a wgmma operand in flight in the K loops, no cp.async wait there and no barrier but the MMA warpgroup's own 128 threads (before one
    thread frees a stage, and before a slice's partial sums are counted), the producer's warpgroup at its 24
    registers."""
    decode = {name: got for name, got in compiled.items() if name.startswith("DL")}
    assert len(decode) == 12
    for name, got in decode.items():
        sync_mma = int(name.split("_")[5]) < 64
        assert got["mma16"] != sync_mma and not got["mma64"] and not got["staged_operand"], name
        assert got["hmma_loops"] == sync_mma, name
        assert got["hgmma_loops"] and got["loop_spills"] == 0, name
        assert got["in_flight_writes"] == [], (name, got["in_flight_writes"][:5])
        assert got["barrier_threads"] == [128], (name, got["barrier_threads"])
        assert all(waits == 0 for waits, _, _ in got["syncs"]), (name, got["syncs"])
        assert hopper_prefill_ws.PRODUCER_REGS.value in got["setmaxnreg"], (name, got["setmaxnreg"])
