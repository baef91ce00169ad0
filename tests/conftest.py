import os
import sys
import tempfile

import pytest

# tests import the shared harness as `tests.distributed`
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Without an NVIDIA GPU, the Triton Mega MoE kernels run under Triton's CPU interpreter. `triton.jit` reads
# the switch when planc's kernels are defined (first import), so it is set before any test imports planc.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_under_pytest(tmp_path_factory):
    """Everything the tests' processes put in the temporary directory (torchrun's `torchelastic_*` log dirs,
    torch.multiprocessing's error files, any library's scratch files) goes under pytest's own base directory, which
    pytest prunes, instead of /tmp: subprocesses read TMPDIR, this process reads tempfile.tempdir."""
    scratch = tmp_path_factory.mktemp("tmpdir")
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = str(scratch)
    yield
    if saved[0] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved[0]
    tempfile.tempdir = saved[1]
