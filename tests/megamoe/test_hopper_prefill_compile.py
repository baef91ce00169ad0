"""The Hopper Gluon kernels (`hopper_prefill`) compiled for sm_90 here, without a GPU: Triton's own compiler and
ptxas, the installed Triton's Gluon API. What is checked is what a CPU can see: the kernels compile for the tuned
configs, the weight operand reaches the wgmma from registers without a shuffle (the kernels assert it: `_expand`'s
`convert_layout(..., assert_trivial=True)`), the wgmma are waited on one step late (async), and no register spills.
The numbers are checked on a GPU (`test_triton_gpu.py`: the same bits as the Triton kernels).

The compiler runs in a child process: this one may have defined planc's Triton functions for the CPU interpreter
(tests/conftest.py), which a compiled Gluon kernel cannot call."""

import json
import os
import subprocess
import sys

import pytest

from planc.runtime.megamoe import hopper_prefill
from planc.runtime.megamoe.triton_backend import _GLUON_CONFIGS

pytestmark = pytest.mark.skipif(hopper_prefill.gluon is None, reason="this Triton has no Gluon")

COMPILE = r'''
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from planc.runtime.megamoe import hopper_prefill

def compile_sm90(kernel, **constexprs):
    pointer_types = {"x_ptr": "*bf16", "a_ptr": "*bf16", "out_ptr": "*bf16", "weight_ptr": "*fp32"}
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, "*i32")
        else:
            signature[name] = "fp32" if name == "clamp" else "i32"
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if name.endswith("_ptr") or name.startswith("stride") or name in ("hidden", "inter")}
    src = GluonASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": constexprs["num_warps"]})

def spills(cubin):
    """Bytes of stack frame per thread (register spills land there) in the cubin, from the cuobjdump that Triton ships."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    return sum(int(n) for n in re.findall(r"STACK:(\d+)", usage))

out = {}
for layer, bn, warps, stages, large in json.loads(sys.argv[1]):
    common = dict(BN=bn, STAGES=stages, LARGE=large, num_warps=warps)
    if layer == "L1":
        kernel = compile_sm90(hopper_prefill._l1_kernel, HAS_CLAMP=True, **common)
    else:
        kernel = compile_sm90(hopper_prefill._l2_kernel, **common)
    ptx = kernel.asm["ptx"]
    out[f"{layer}_{bn}_{warps}_{stages}_{large}"] = dict(
        waits=sorted({int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx)}),
        mma64="wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in ptx,
        mma16="wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16" in ptx,
        staged_operand="stmatrix" in ptx or "st.shared.b16" in ptx,
        spills=spills(kernel.asm["cubin"]))
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def compiled():
    """Every tuned config, both layers, both scale expansions, compiled in one child process."""
    variants = [(layer, c.l1_n if layer == "L1" else c.l2_n, c.num_warps, c.num_stages, large)
                for _, c in _GLUON_CONFIGS if c is not None for layer in ("L1", "L2") for large in (False, True)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(variants)], capture_output=True, text=True,
                         env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_compiles_for_sm90_with_async_wgmma_and_no_spills(compiled):
    assert len(compiled) == 4 * sum(c is not None for _, c in _GLUON_CONFIGS)
    for name, got in compiled.items():
        # The K loops (0, 1 or 2 tail MMAs per operand) wait with this tile's MMAs still in flight.
        assert {1, 2, 3} <= set(got["waits"]), name
        assert got["mma64"] and got["mma16"], name
        assert not got["staged_operand"], name  # the weight operand never goes through shared memory
        assert got["spills"] == 0, name
