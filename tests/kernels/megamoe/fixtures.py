"""Fixtures of the Mega MoE tests (kernels and runtime glue): a one-rank group, a fresh buffer cache per test."""

import pytest
import torch.distributed as dist

from planc.kernels.megamoe.buffers import destroy_megamoe_buffers
from tests.distributed import free_port


@pytest.fixture(scope="session")
def world1():
    """A one-rank gloo group in the test process: the experts forward always takes an EP group."""
    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        created = True
    elif dist.get_world_size() != 1:
        pytest.skip("the test process already belongs to a multi-rank process group")
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def fresh_buffers():
    destroy_megamoe_buffers()
    yield
    destroy_megamoe_buffers()
