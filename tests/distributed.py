"""The spawn harness every multi-rank test shares: real gloo process groups on CPU.

`run_distributed(fn, world_size, *args)` is `planc.runtime.local_world.run_local_world`: it spawns
`world_size` processes, initialises gloo on a free port (with retry), calls `fn(rank, world_size, *args)`
and returns the per-rank results. `fn` must be a module-level function.
"""

from planc.runtime.local_world import free_port, run_local_world as run_distributed

__all__ = ["free_port", "run_distributed"]
