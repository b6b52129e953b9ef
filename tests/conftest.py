"""Shared fixtures: the compiled ops (built or loaded once per session, only for the tests that ask
for ``cpu_op``, in this process, or ``built_ops``, for their launched ranks) and random sparse
indices. Shared helper functions live in helpers.py.

Run order: the op-builder tests run first. With an empty extension cache the JIT test's build (into
the session's cache) is the session's build of the CPU op: one compile, not two. Beside it a
subprocess builds DeepSpeed's shm comm op (which every ``deepspeed.init_distributed`` loads, ~50 s
of CPU to compile), so that no launched rank compiles it: a launch killed or timed out mid-build
leaves the cache's lock file behind, and every later launch waits on it forever. (A subprocess,
not a thread: a build in a thread of this process broke pytest's output capture of the test
running beside it, "Bad file descriptor" at its teardown; DeepSpeed's builder redirects file
descriptor 2 while it probes the compiler.)

Background builds: a test marked ``background_build(command=...)`` waits for a build that starts at
collection, niced, and the test runs last. Such a build (the prebuilt install, every CUDA source
under nvcc: minutes of CPU) takes the CPU time the rest of the suite leaves idle instead of
running beside the JIT build or in a test of its own; the niced build barely slows the timed
multi-process tests. The ``background_build`` fixture hands the test its (process, log, directory).

Nothing outside the temporary folders: what the session writes beyond the tests' ``tmp_path``
(the datasets cache of the files the tests read, which takes a new entry per path and so grew
with every run; the ops' build log; the background builds) goes to one folder of its own, removed
at the end (test_leftovers.py checks a slice of the suite)."""
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from ds_mtraining.distributed import spawn
from helpers import start
from ds_mtraining.index import SparseIndex

# Modules the spawned ranks need, imported once by the forkserver that forks every rank (a fresh
# interpreter per rank spends seconds of CPU on these imports, and a run starts ~40 ranks).
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "ds_mtraining", "deepspeed", "transformers", "helpers"]
JIT_TEST = "test_jit_build_in_fresh_extension_dir"
BUILD_TIMEOUT_S = 900


SESSION_DIR = Path(tempfile.mkdtemp(prefix="ds_mtraining-tests-"))  # removed at the session's end


def pytest_configure(config):
    # launched ranks and spawned processes inherit it (set before anything imports datasets)
    os.environ["HF_DATASETS_CACHE"] = str(SESSION_DIR / "datasets")
    config.addinivalue_line(
        "markers", "slow: builds or installs the package (minutes); CI runs it, "
                   "deselect locally with -m 'not slow'")
    config.addinivalue_line(
        "markers", "background_build(command=f): f(directory) -> (argv, env) or None (nothing to "
                   "build here); started niced at collection, the test runs last (module docstring)")
    # the forkserver (Python 3.11) imports its preload before it takes this process's sys.path:
    # without tests/ on PYTHONPATH it would skip helpers and forkserver_ops (ImportError is ignored)
    tests = str(Path(__file__).parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    spawn.START_METHOD = "forkserver"


def pytest_collection_modifyitems(session, config, items):
    def place(item):  # the op-builder tests first, the background builds' tests last; stable otherwise
        return 2 if item.get_closest_marker("background_build") else int(item.path.name != "test_op_builder.py")
    items.sort(key=place)


_op_build: dict = {}
_background: dict = {}  # test node id -> (process, log, directory)


def _start_background_builds(items):
    for item in items:
        marker = item.get_closest_marker("background_build")
        if marker is None:
            continue
        directory = Path(tempfile.mkdtemp(prefix="background-", dir=SESSION_DIR))
        job = marker.kwargs["command"](directory)
        if job is None:
            shutil.rmtree(directory)
            continue
        command, env = job
        log = directory / "build.log"
        niced = ["nice", "-n", "19", *command] if shutil.which("nice") else command
        # its compilers' temporary files in its own folder too: an nvcc killed mid-build (timed out,
        # or ended with the session) leaves its tmpxft_* files where TMPDIR says
        process = start(niced, log, dict(env, TMPDIR=str(directory)))  # a session of its own: killed whole at the end
        try:  # a new session is a scheduler autogroup, weighted by its own nice, not its processes'
            Path(f"/proc/{process.pid}/autogroup").write_text("19")
        except OSError:  # no autogroups here: the processes' nice is what counts
            pass
        _background[item.nodeid] = (process, log, directory)


@pytest.fixture
def background_build(request):
    """(process, log, directory) of the build this test's ``background_build`` marker started."""
    job = _background.get(request.node.nodeid)
    if job is None:
        pytest.fail(f"no background build was started for {request.node.nodeid}")
    return job


def _build_ops_code(with_cpu_op: bool) -> str:
    code = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
    return code + ("; from ds_mtraining import ops; ops.op_module('cpu')" if with_cpu_op else "")


def pytest_collection_finish(session):
    """Starts the selected tests' background builds. When a selected test asks for ``cpu_op``:
    starts the ops' build (or cache load) in a subprocess, the CPU op's only when the JIT test
    (which may build it) is not selected, and lets the forkserver preload both for the ranks it
    forks."""
    _start_background_builds(session.items)
    if any({"cpu_op", "built_ops"} & set(getattr(item, "fixturenames", ())) for item in session.items):
        jit_test = any(item.name == JIT_TEST for item in session.items)
        log = SESSION_DIR / "ops-build.log"
        with log.open("w") as handle:
            _op_build.update(log=log, builds_cpu_op=not jit_test, process=subprocess.Popen(
                [sys.executable, "-c", _build_ops_code(not jit_test)], stdout=handle, stderr=subprocess.STDOUT))
        multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD + ["forkserver_ops"])


def pytest_sessionfinish(session, exitstatus):
    """Ends the background builds that no test waited for (they write only their own directory).
    Lets an ops' build that no test waited for finish: killed mid-build it would leave the
    cache's lock file behind, on which every later build waits forever. Then removes the
    session's folder."""
    for process, _, _ in _background.values():
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    process = _op_build.get("process")
    if process is not None:
        try:
            process.wait(BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    shutil.rmtree(SESSION_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def built_ops():
    """The compiled CPU module (prebuilt, or JIT-compiled once into the extension cache) and
    DeepSpeed's shm comm op, both built: multi-process tests ask for it (``usefixtures``), so that
    their spawned ranks or launched processes load both from the cache instead of compiling at
    once. (Tests that call the op without asking wait for the same build: ``ops.op_module`` holds
    a lock while it builds.)"""
    from ds_mtraining import ops
    process = _op_build.get("process")
    if process is None:
        subprocess.run([sys.executable, "-c", _build_ops_code(True)], check=True, timeout=BUILD_TIMEOUT_S)
    else:
        try:
            code = process.wait(BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            from ds_mtraining_op_builder import extension_root
            pytest.fail(f"the ops' build still runs after {BUILD_TIMEOUT_S} s (a killed build's lock file "
                        f"left in {extension_root()}?)")
        if code != 0:
            pytest.fail(f"the ops' build failed (exit {code}):\n" + _op_build["log"].read_text()[-3000:])
    return ops.op_module("cpu")  # from the cache: the subprocess or the JIT test built it


@pytest.fixture(scope="session")
def cpu_op(request):
    """The compiled CPU module, for tests that call the op in this process. When the JIT test
    built it (it runs first), loaded from the cache at once, while the shm op may still be
    building beside the in-process tests; otherwise it waits for ``built_ops``."""
    from ds_mtraining import ops
    if _op_build.get("builds_cpu_op", True):
        return request.getfixturevalue("built_ops")
    return ops.op_module("cpu")


@pytest.fixture(scope="session", autouse=True)
def deepspeed_shm_buffers():
    """Removes the /dev/shm buffers that this session's launches left: DeepSpeed's shm allreduce
    never unlinks its 66 MiB per rank, so every run of the suite left a few hundred MB of memory
    behind, until the machine ran out. Buffers that a live process still maps (another run's)
    are kept."""
    shm = Path("/dev/shm")
    before = set(shm.glob("deepspeed_allreduce_buffer_*"))
    yield
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split()[-1] for line in maps.read_text().splitlines() if "/dev/shm/" in line)
        except OSError:  # the process ended meanwhile
            continue
    for buffer in set(shm.glob("deepspeed_allreduce_buffer_*")) - before:
        if str(buffer) not in mapped:
            buffer.unlink(missing_ok=True)


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
