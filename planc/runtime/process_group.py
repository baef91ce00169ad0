"""Start the default process group from torchrun's environment, as transformers' `from_pretrained(tp_plan=)` does.

A script launched with `torchrun` has RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set but no process group
until someone calls `init_process_group`; `planc.load` and `planc.apply` make that call themselves (NCCL when
a CUDA GPU is visible, with this process's GPU set from LOCAL_RANK; gloo on CPU), so the README's snippet runs
as written. Where neither a group nor that environment exists, the error names what is missing.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from planc.errors import ApplyError

# What `init_process_group(init_method="env://")` reads; torchrun sets all four (and LOCAL_RANK).
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def ensure_process_group(what: str) -> None:
    """Return when the default process group is up, starting it from torchrun's environment if needed;
    ApplyError naming the missing variables otherwise. `what`: the caller (planc.load, planc.apply)."""
    if not dist.is_available():
        raise ApplyError(f"{what}: this torch build has no torch.distributed; install a build with it (the PyPI "
                         "wheels have it).")
    if dist.is_initialized():
        return
    missing = [name for name in TORCHRUN_VARIABLES if not os.environ.get(name)]
    if missing:
        found = [name for name in TORCHRUN_VARIABLES if name not in missing]
        where = (f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set (found "
                 f"{', '.join(found)})" if found else "this process was not launched by torchrun (none of "
                 f"{', '.join(TORCHRUN_VARIABLES)} is set)")
        raise ApplyError(
            f"{what}: torch.distributed is not initialized and {where}. Run the script with "
            "`torchrun --nproc-per-node N script.py` (N = the plan's world size, or the `parallel=` sizes' product), "
            "or call torch.distributed.init_process_group(...) yourself before this call."
        )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    local = os.environ.get("LOCAL_RANK", "")
    if backend == "nccl" and local.isdigit():
        torch.cuda.set_device(int(local))
    dist.init_process_group(backend)


__all__ = ["TORCHRUN_VARIABLES", "ensure_process_group"]
