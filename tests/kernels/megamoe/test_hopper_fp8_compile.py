"""The FP8 Gluon kernels (`hopper_fp8`, and `hopper_fp8_ws` warp-specialized) compiled for sm_90 here, without a GPU (Triton's compiler and ptxas, as
`test_hopper_prefill_compile.py` does for the BF16 ones, with its SASS helpers). What a CPU can see: the kernels
compile for the configs the benchmark sweeps; the e4m3 operand reaches the FP8 wgmma (QGMMA) from registers (the
kernel asserts the layout: `expand_e4m3`'s `convert_layout(..., assert_trivial=True)`; no shared-memory store in the K
loops); ptxas keeps a wgmma in flight while a block sum is promoted (it serializes every wgmma of a kernel where it
cannot prove an accumulator read safe, C7514); no spills in the K loops; no register write into a wgmma's operand
still in flight. The numbers are checked on a GPU (`test_triton_gpu.py`, against the float64 emulation).

`python -m tests.kernels.megamoe.test_hopper_fp8_compile [variants-json]` prints the same facts with the register and
spill counts (the GPU script's ptxas dump).
"""

import json
import subprocess
import sys

import pytest

from planc.kernels.megamoe.triton import hopper_fp8_ws, hopper_prefill, hopper_prefill_ws
from tests.checkout_env import checkout_env
from tests.kernels.megamoe.test_hopper_prefill_compile import COMPILE

pytestmark = pytest.mark.skipif(hopper_prefill.gluon is None, reason="this Triton has no Gluon")

# (layer, block rows, warps, stages, register cap): the configs `bench/megamoe_gpu.py --sweep` runs on the GPU
VARIANTS = [("L1", 64, 8, 4, 0), ("L2", 64, 4, 4, 0)]
# the row-scaled kernels (fp8=6: no promotion): L1 on 4 warps (three programs an SM), L2 on 4 (four); with 80-row
# blocks (a 16-row tail MMA) L1 capped at 168 (three), L2 three (its shared memory), L2 on 8 warps capped at 128 (two)
ROW_VARIANTS = [("L1R", 64, 4, 4, 0), ("L2R", 64, 4, 4, 0), ("L1R", 80, 4, 4, 168), ("L2R", 80, 4, 4, 0),
                ("L2R", 80, 8, 4, 128)]
# the warp-specialized kernels (`hopper_fp8_ws`, fp8=4) at their default cap: L1 on 4 warps in one pass (64
# channels) and in two (128), L2; and L1 on 8 MMA warps
WS_VARIANTS = [("L1WS", 64, 4, 4, 0), ("L1WS2", 64, 4, 4, 0), ("L2WS", 64, 4, 4, 0), ("L1WS", 64, 8, 4, 168)]
# with the converter warps (fp8=5) at their default caps: L1 in two passes, L2
CV_VARIANTS = [("L1CV2", 64, 4, 3, 0), ("L2CV", 64, 4, 4, 0)]

FP8_COMPILE = COMPILE[:COMPILE.index("out = {}")] + r'''
from planc.kernels.megamoe.triton import hopper_fp8
POINTERS = {"x8_ptr": "*fp8e4nv", "a8_ptr": "*fp8e4nv", "out_ptr": "*bf16", "weight_ptr": "*fp32",
            "xs_ptr": "*fp32", "as_ptr": "*fp32", "outs_ptr": "*fp32", "a32_ptr": "*fp32"}

from planc.kernels.megamoe.triton import hopper_fp8_ws

def ws_types(warps):
    """`hopper_fp8_ws.descriptors`' TMA descriptor types, as the launcher names them."""
    _, plain = hopper_prefill_ws.tma_layouts()
    return {"w_desc": f"tensordesc<i32[{warps}, 256],{plain!r}>", "s_desc": f"tensordesc<i32[1, {16 * warps}],{plain!r}>"}

out = {}
for layer, rows, warps, stages, maxnreg in json.loads(sys.argv[1]):
    if layer in ("L1", "L1R"):  # R: row-scaled (fp8=6)
        kernel = compile_sm90(hopper_fp8.l1_kernel, maxnreg, pointer_types={**POINTERS, "out_ptr": "*u8"},
                              HAS_CLAMP=True, ROWS=rows, STAGES=stages, num_warps=warps, ROW_SCALED=layer == "L1R")
    elif layer[2:4] in ("WS", "CV"):  # the warp-specialized kernels (`hopper_fp8_ws`); CV: fp8=5; L1WS2: two passes
        gated = layer.startswith("L1")
        cap = hopper_fp8_ws.CONVERT_DEFAULT_REGISTERS if layer[2:4] == "CV" else hopper_fp8_ws.DEFAULT_REGISTERS
        kernel = compile_sm90(hopper_fp8_ws.fp8_ws_kernel, maxnreg or cap, ws_types(warps),
                              {**POINTERS, "x_ptr": "*fp8e4nv", "out_ptr": "*u8" if gated else "*bf16"},
                              GATED=gated, HAS_CLAMP=gated, ROWS=rows, STAGES=stages,
                              PASSES=2 if layer.endswith("2") else 1, CONVERT=layer[2:4] == "CV",
                              CONVERT_REGS=hopper_fp8_ws.CONVERT_REGISTERS, num_warps=warps)
    else:
        kernel = compile_sm90(hopper_fp8.l2_kernel, maxnreg, pointer_types=POINTERS, ROWS=rows, STAGES=stages,
                              num_warps=warps, ROW_SCALED=layer == "L2R")
    text, usage = sass(kernel.asm["cubin"]), cuobjdump(kernel.asm["cubin"], "-res-usage")
    k_loops = loops(text)
    # the converter's loop (fp8=5): the innermost loop without an MMA that expands words (PRMT) into shared memory
    expand = [b for b in loops(text, mma=False) if any("PRMT" in x for x in b) and any("STS" in x for x in b)]
    expand = [min(expand, key=len)] if expand else []
    body = [x for b in k_loops for x in b]
    out[f"{layer}_{rows}_{warps}_{stages}_{maxnreg}"] = dict(
        registers=int(re.search(r"REG:(\d+)", usage).group(1)),
        stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
        spills=sum(bool(re.search(r"\b(LDL|STL)\b", x)) for x in text.splitlines()),
        loop_spills=sum(bool(re.search(r"\b(LDL|STL)\b", x)) for x in body),
        qgmma=[sum("QGMMA" in x for x in b) for b in k_loops],
        loop_sts=sum(bool(re.search(r"\bSTS\b", x)) for x in body),
        loop_ldg=sum(bool(re.search(r"\bLDG\b", x)) for x in body),
        shared_bytes=kernel.metadata.shared,
        convert=[dict(instructions=len(b), prmt=sum("PRMT" in x for x in b), f2fp=sum("F2FP" in x for x in b), sts=sum(bool(re.search(r"\bSTS", x)) for x in b),
                      wide=sum("STS.128" in x or x.startswith("STSM") for x in b), spills=sum(bool(re.search(r"\b(LDL|STL)\b", x)) for x in b))
                 for b in expand],
        # wgmma waits that leave commit groups in flight (0x1; 0x2 where an operand's MMAs are two groups)
        async_waits=sum(bool(re.search(r"DEPBAR\.LE gsb0, 0x[1-9]", x)) for x in body),
        full_waits=sum("DEPBAR.LE gsb0, 0x0" in x for x in body),
        loops=len(k_loops),
        in_flight_writes=in_flight_writes(text),
        loop_instructions=[len(b) for b in k_loops],
        # per K loop: cp.async waits, CTA barriers, proxy fences; the threads each barrier there waits for
        syncs=[[sum(bool(re.match(p, x)) for x in b) for p in (r"DEPBAR\.LE SB0", r"BAR\.SYNC", r"FENCE\.VIEW\.ASYNC")]
               for b in k_loops],
        barrier_threads=sorted({int(m.group(1), 16) for b in k_loops for x in b
                                for m in [re.match(r"BAR\.SYNC\S*\s+0x[0-9a-f]+,\s*(0x[0-9a-f]+)", x)] if m}),
        setmaxnreg=sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);",
                                                       kernel.asm["ptx"])}))
print(json.dumps(out))
'''


def compile_variants(variants) -> dict:
    """Compile the variants in a child process (this one may run planc's Triton functions under the interpreter)."""
    env = checkout_env()
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-c", FP8_COMPILE, json.dumps(variants)], capture_output=True, text=True,
                         env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def compiled():
    return compile_variants(VARIANTS + ROW_VARIANTS + WS_VARIANTS + CV_VARIANTS)


def test_fp8_kernels_multiply_e4m3_registers_without_serializing_or_spilling(compiled):
    assert len(compiled) == len(VARIANTS + ROW_VARIANTS + WS_VARIANTS + CV_VARIANTS)
    for name, got in compiled.items():
        if "WS" in name or "CV" in name or "R_" in name:
            continue
        # a K loop for blocks of 64 rows and one for an expert's last block of up to 32 (an MMA half as wide)
        assert got["loops"] == 2, name
        # two operand blocks per iteration (L1: gate and up; L2: two K blocks), 4 k32 steps each
        assert got["qgmma"] == [8, 8], name
        assert got["loop_sts"] == 0, name  # the expanded operand never goes through shared memory
        assert got["loop_spills"] == 0, name
        # each block sum is promoted with the other block's MMA in flight (one wait for both per iteration); ptxas
        # serializing the kernel (C7514) would wait after every QGMMA
        assert got["async_waits"] >= 2 * got["loops"] and got["full_waits"] <= got["loops"], (name, got)
        assert got["in_flight_writes"] == [], (name, got["in_flight_writes"][:5])


def test_row_scaled_kernels_keep_a_wgmma_in_flight_across_iterations(compiled):
    """fp8=6 reads no accumulator in its K loop: one wait for the MMAs before the last per operand, none for all of
    them (fp8=3 ends each iteration waiting for its last), no spill in the loops; L1 fits three programs an SM, L2
    four (80-row blocks: three, by registers and shared memory; L2 on 8 warps: two)."""
    for (layer, rows, warps, stages, cap), programs in zip(ROW_VARIANTS, (3, 4, 3, 3, 2)):
        got = compiled[f"{layer}_{rows}_{warps}_{stages}_{cap}"]
        # 80-row blocks: the loop with the 16-row tail MMA (16 QGMMA: 4 k32 steps x 2 operands x 2 widths), the one
        # without it; else the full and the half-width loop
        assert got["loops"] == 2 and got["qgmma"] == ([16, 8] if rows == 80 else [8, 8]), (layer, got)
        assert got["loop_sts"] == 0 and got["loop_spills"] == 0, (layer, got)
        # the e4m3 tables come from the scale words in registers (`hopper_fp8.table_words`): no global load waits
        # behind the stage copies between the scale words and the MMA
        assert got["loop_ldg"] == 0, (layer, got)
        # each loop waits for all but the last operand's MMAs (one commit group per MMA width) twice an iteration; a
        # serialized kernel (C7514) waits for all of them
        assert got["full_waits"] == 0, (layer, got)
        assert got["async_waits"] == 2 * got["loops"], (layer, got)
        assert got["in_flight_writes"] == [], (layer, got["in_flight_writes"][:5])
        assert programs * 32 * warps * ((got["registers"] + 7) // 8 * 8) <= 65536, (layer, got["registers"])
        assert programs * (got["shared_bytes"] + 1024) <= 228 * 1024, (layer, got["shared_bytes"])
        if rows == 64:  # fewer instructions per iteration than fp8=3's loop at the tiles `VARIANTS` compiles
            plain = compiled["_".join(map(str, next(v for v in VARIANTS if v[0] == layer[:2])))]
            assert max(got["loop_instructions"]) < min(plain["loop_instructions"]), (layer, got, plain)
            assert got["spills"] == 0, (layer, got)


@pytest.mark.skipif(hopper_fp8_ws.unavailable_reason is not None, reason=str(hopper_fp8_ws.unavailable_reason))
def test_warp_specialized_fp8_kernels_leave_the_copies_to_the_producer(compiled):
    """`hopper_fp8_ws`: the same loops as `hopper_fp8` (two per pass, 8 QGMMA each, the e4m3 operand from
    registers, a block sum promoted with the other MMA in flight, no writes into an operand in flight), and what the
    producer warp is for: no cp.async wait in the MMA warps' loops, no barrier there but the MMA warps' own (before
    one thread frees a stage), the producer's warpgroup at its 24 registers. The one reload from the stack a loop
    may hold is the thread index, for the thread that frees the stage (ptxas keeps it on the stack across the
    partitions' `setmaxnreg`)."""
    ws = {name: got for name, got in compiled.items() if "WS" in name}
    assert len(ws) == len(WS_VARIANTS)
    for name, got in ws.items():
        warps = int(name.split("_")[2])
        loops = 4 if name.startswith("L1WS2") else 2  # a loop per pass and body width
        assert got["loops"] == loops and got["qgmma"] == [8] * loops and got["loop_sts"] == 0, (name, got)
        assert got["loop_spills"] <= got["loops"], (name, got["loop_spills"])
        assert got["async_waits"] >= 2 * got["loops"] and got["full_waits"] <= got["loops"], (name, got)
        assert got["in_flight_writes"] == [], (name, got["in_flight_writes"][:5])
        assert got["barrier_threads"] == [32 * warps], (name, got["barrier_threads"])
        assert all(waits == 0 for waits, _, _ in got["syncs"]), (name, got["syncs"])
        assert hopper_prefill_ws.PRODUCER_REGS.value in got["setmaxnreg"], (name, got["setmaxnreg"])


@pytest.mark.skipif(hopper_fp8_ws.unavailable_reason is not None, reason=str(hopper_fp8_ws.unavailable_reason))
def test_converter_warps_expand_into_shared_memory_and_the_mma_warps_only_multiply(compiled):
    """fp8=5: the MMA warps' loops take both operands from shared memory (8 QGMMA per loop, no expansion: no PRMT,
    no shared-memory store, no spill, a block sum promoted with the other MMA in flight, only their own barrier);
    the converter's loop expands each stage's words (16 PRMT per operand and lane) into 16-byte stores (STS.128 or
    stmatrix), and two programs fit an SM (shared memory under half of the SM's 228 KB, the caps as `CONVERT_DEFAULT_REGISTERS` says)."""
    cv = {name: got for name, got in compiled.items() if "CV" in name}
    assert len(cv) == len(CV_VARIANTS)
    for name, got in cv.items():
        gated = name.startswith("L1")
        loops = 4 if name.startswith("L1CV2") else 2  # a loop per pass and body width
        assert got["loops"] == loops and got["qgmma"] == [8] * loops and got["loop_sts"] == 0, (name, got)
        assert got["loop_spills"] == 0, (name, got["loop_spills"])
        assert got["async_waits"] >= 2 * got["loops"] and got["full_waits"] <= got["loops"], (name, got)
        assert got["barrier_threads"] == [128], (name, got["barrier_threads"])
        assert got["shared_bytes"] <= 228 * 1024 // 2 - 1024, (name, got["shared_bytes"])
        [conv] = got["convert"]
        # the subnormal table rows' branch (`hopper_fp8.table_words`) packs its 4 conversions with 2 PRMT
        expand = conv["prmt"] - conv["f2fp"] // 2
        assert expand == (32 if gated else 16) and conv["sts"] == conv["wide"] == expand // 4, (name, conv)
        assert conv["spills"] <= 4, (name, conv)  # a few values the partition keeps on the stack (Triton 3.6: 2, 3.9: 3)
        assert {hopper_prefill_ws.PRODUCER_REGS.value, hopper_fp8_ws.CONVERT_REGISTERS} <= set(got["setmaxnreg"]), name


if __name__ == "__main__":  # the GPU script's register and spill dump
    print(json.dumps(compile_variants(json.loads(sys.argv[1]) if len(sys.argv) > 1 else VARIANTS), indent=1))
