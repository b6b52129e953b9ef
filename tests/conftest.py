"""Shared fixtures: the CPU op (compiled or loaded once per session) and random sparse indices."""
import pytest
import torch

from ds_mtraining.index import SparseIndex


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: builds or installs the package (minutes); CI runs it, "
                   "deselect locally with -m 'not slow'")


@pytest.fixture(scope="session", autouse=True)
def cpu_op():
    """The compiled CPU module (prebuilt or JIT-compiled on first use), built before any test so
    that spawned ranks and launched processes load it from the cache instead of all compiling."""
    from ds_mtraining import ops
    return ops.op_module("cpu")


@pytest.fixture
def random_index():
    """Factory of a random vertical-slash index: ``n_vertical`` key columns and ``n_slash`` token
    diagonals per head (a quarter of each is -1 padding), plus the local diagonal."""
    def make(batch, heads, seq_len, block_size, n_vertical=8, n_slash=3, seed=0) -> SparseIndex:
        generator = torch.Generator().manual_seed(seed)
        vertical = torch.randint(0, seq_len, (batch, heads, n_vertical), generator=generator)
        slash = torch.randint(0, seq_len, (batch, heads, n_slash), generator=generator)
        vertical[..., : n_vertical // 4] = -1
        slash[..., : n_slash // 4] = -1
        return SparseIndex.from_vertical_slash(vertical, slash, seq_len, block_size)
    return make
