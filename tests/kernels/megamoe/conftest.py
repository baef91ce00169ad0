from tests.kernels.megamoe.fixtures import fresh_buffers, world1  # noqa: F401 - this folder's fixtures
