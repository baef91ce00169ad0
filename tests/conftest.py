import os
import sys

# tests import the shared harness as `tests.distributed`
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Without an NVIDIA GPU, the Triton Mega MoE kernels run under Triton's CPU interpreter. `triton.jit` reads
# the switch when planc's kernels are defined (first import), so it is set before any test imports planc.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
