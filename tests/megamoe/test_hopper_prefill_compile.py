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

def sass(cubin):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        return subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout

def in_flight_writes(text):
    """Writes to the A-operand registers of a wgmma still in flight: each loop holding HGMMAs is cut at its
    WARPGROUP.DEPBARs; the HGMMAs of one segment are in flight during the next (cyclically), and a wgmma reads its
    registers until it is waited for (ptxas reuses registers that PTX no longer uses)."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in text.splitlines()) if m]
    at = {a: i for i, (a, _) in enumerate(ins)}
    found = []
    for i, (_, t) in enumerate(ins):
        m = re.search(r"BRA\s.*?(0x[0-9a-f]+)", t)
        lo = at.get(int(m.group(1), 16)) if m else None
        if lo is None or lo >= i:
            continue
        body = [x for _, x in ins[lo:i + 1]]
        cuts = [k for k, x in enumerate(body) if "WARPGROUP.DEPBAR" in x]
        segs = [body[a:b] for a, b in zip([0] + cuts, cuts + [len(body)])]
        def a_regs(seg):
            regs = set()
            for x in seg:
                mm = re.search(r"HGMMA\.\S+\s+R\d+,\s*R(\d+),", x)
                if mm:
                    regs |= set(range(int(mm.group(1)), int(mm.group(1)) + 4))
            return regs
        with_mma = [j for j, sg in enumerate(segs) if a_regs(sg)]
        for j, sg in enumerate(segs):
            prev = [p for p in with_mma if p < j] or [p for p in with_mma if p >= j]
            pending = a_regs(segs[prev[-1]]) if prev else set()
            for x in sg:
                mm = re.match(r"(?:@!?U?P\w+\s+)?([A-Z][\w.]*)\s+R(\d+)\b", x)
                if mm and not mm.group(1).startswith(("HGMMA", "ST", "WARPGROUP")) and int(mm.group(2)) in pending:
                    found.append(x)
    return found

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
        spills=spills(kernel.asm["cubin"]),
        hgmma_loops=sass(kernel.asm["cubin"]).count("HGMMA") > 0,
        in_flight_writes=in_flight_writes(sass(kernel.asm["cubin"])))
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
        # The next operand is expanded while the last MMAs run: never into registers those MMAs still read.
        assert got["hgmma_loops"] and got["in_flight_writes"] == [], (name, got["in_flight_writes"][:5])
