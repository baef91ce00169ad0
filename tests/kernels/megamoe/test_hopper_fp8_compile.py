"""The FP8 Gluon kernels (`hopper_fp8`) compiled for sm_90 here, without a GPU (Triton's compiler and ptxas, as
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

from planc.kernels.megamoe.triton import hopper_prefill
from tests.checkout_env import checkout_env
from tests.kernels.megamoe.test_hopper_prefill_compile import COMPILE

pytestmark = pytest.mark.skipif(hopper_prefill.gluon is None, reason="this Triton has no Gluon")

# (layer, block rows, warps, stages, register cap): the configs `bench/megamoe_gpu.py --sweep` runs on the GPU
VARIANTS = [("L1", 64, 8, 4, 0), ("L2", 64, 4, 4, 0)]

FP8_COMPILE = COMPILE[:COMPILE.index("out = {}")] + r'''
from planc.kernels.megamoe.triton import hopper_fp8
POINTERS = {"x8_ptr": "*fp8e4nv", "a8_ptr": "*fp8e4nv", "out_ptr": "*bf16", "weight_ptr": "*fp32",
            "xs_ptr": "*fp32", "as_ptr": "*fp32", "outs_ptr": "*fp32", "tab_ptr": "*i64", "a32_ptr": "*fp32"}

out = {}
for layer, rows, warps, stages, maxnreg in json.loads(sys.argv[1]):
    if layer == "L1":
        kernel = compile_sm90(hopper_fp8.l1_kernel, maxnreg, pointer_types={**POINTERS, "out_ptr": "*u8"},
                              HAS_CLAMP=True, ROWS=rows, STAGES=stages, num_warps=warps)
    else:
        kernel = compile_sm90(hopper_fp8.l2_kernel, maxnreg, pointer_types=POINTERS, ROWS=rows, STAGES=stages,
                              num_warps=warps)
    text, usage = sass(kernel.asm["cubin"]), cuobjdump(kernel.asm["cubin"], "-res-usage")
    k_loops = loops(text)
    body = [x for b in k_loops for x in b]
    out[f"{layer}_{rows}_{warps}_{stages}_{maxnreg}"] = dict(
        registers=int(re.search(r"REG:(\d+)", usage).group(1)),
        stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
        spills=sum(bool(re.search(r"\b(LDL|STL)\b", x)) for x in text.splitlines()),
        loop_spills=sum(bool(re.search(r"\b(LDL|STL)\b", x)) for x in body),
        qgmma=[sum("QGMMA" in x for x in b) for b in k_loops],
        loop_sts=sum(bool(re.search(r"\bSTS\b", x)) for x in body),
        async_waits=sum("DEPBAR.LE gsb0, 0x1" in x for x in body),
        full_waits=sum("DEPBAR.LE gsb0, 0x0" in x for x in body),
        loops=len(k_loops),
        in_flight_writes=in_flight_writes(text))
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
    return compile_variants(VARIANTS)


def test_fp8_kernels_multiply_e4m3_registers_without_serializing_or_spilling(compiled):
    assert len(compiled) == len(VARIANTS)
    for name, got in compiled.items():
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


if __name__ == "__main__":  # the GPU script's register and spill dump
    print(json.dumps(compile_variants(json.loads(sys.argv[1]) if len(sys.argv) > 1 else VARIANTS), indent=1))
