"""Shared fixtures: the CPU op (compiled or loaded once per session, only for the tests that ask
for it) and random sparse indices. Shared helper functions live in helpers.py.

Run order: the op-builder tests (which compile the op in subprocesses, ~45 s of CPU each on a
fresh machine) run first, while the session's own op build runs beside them in a thread, so that
the compiles share the cores instead of running one after another."""
import multiprocessing
import threading

import pytest
import torch

from ds_mtraining.distributed import spawn
from ds_mtraining.index import SparseIndex

# Modules the spawned ranks need, imported once by the forkserver that forks every rank (a fresh
# interpreter per rank spends seconds of CPU on these imports, and a run starts ~40 ranks).
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "ds_mtraining", "deepspeed", "transformers", "helpers"]


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: builds or installs the package (minutes); CI runs it, "
                   "deselect locally with -m 'not slow'")
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    spawn.START_METHOD = "forkserver"


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: item.path.name != "test_op_builder.py")  # stable: the rest keep their order


_op_build: dict = {}


def _build_op():
    from ds_mtraining import ops
    try:
        _op_build["module"] = ops.op_module("cpu")
    except BaseException as error:  # re-raised by the fixture
        _op_build["error"] = error


def pytest_collection_finish(session):
    """Starts the op build (or cache load) in a thread when a selected test asks for ``cpu_op``."""
    if any("cpu_op" in getattr(item, "fixturenames", ()) for item in session.items):
        _op_build["thread"] = threading.Thread(target=_build_op, name="cpu-op-build", daemon=True)
        _op_build["thread"].start()


@pytest.fixture(scope="session")
def cpu_op():
    """The compiled CPU module (prebuilt, or JIT-compiled once into the extension cache). Tests
    that call the op in this process ask for it; multi-process tests that call it ask for it too
    (``usefixtures``), so that it is built before their spawned ranks or launched processes start
    and they all load it from the cache instead of compiling at once. (Tests that call the op
    without asking wait for the same build: ``ops.op_module`` holds a lock while it builds.)"""
    thread = _op_build.get("thread")
    if thread is None:
        _build_op()
    else:
        thread.join()
    if "error" in _op_build:
        raise _op_build["error"]
    return _op_build["module"]


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
