"""The training entry point under the real ``deepspeed`` launcher (2 CPU ranks, gloo, ZeRO-2 with
CPU optimizer offload, sparse ring): trains, survives SIGKILL + --resume bit for bit, and runs
from a hostfile of two fake nodes and through Open MPI. Each launch costs ~30-40 s here, so the
runs are few and tiny; the per-step losses come from DeepSpeed's csv monitor (exact float repr).
"""
import csv
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ds_mtraining.distributed import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "ds_configs" / "cpu_demo.json"
STEPS, SAVE_INTERVAL, KILL_AFTER = 20, 5, 12
LAUNCH_TIMEOUT_S = 420
MPI_ARGS = "--allow-run-as-root --oversubscribe --mca btl_tcp_if_include lo -x OMP_NUM_THREADS=1"


def environment() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def train_command(save_dir, *launcher_args, steps=STEPS, config=CONFIG, extra=()) -> list:
    return ["deepspeed", *launcher_args, "--module", "ds_mtraining.train", "--deepspeed_config", str(config),
            "--steps", str(steps), "--save_dir", str(save_dir), "--save_interval", str(SAVE_INTERVAL), *extra]


def start(command, log: Path) -> subprocess.Popen:
    """A launcher in its own session, so that killing its process group ends every rank."""
    return subprocess.Popen(command, cwd=REPO, env=environment(), stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def finish(process: subprocess.Popen, log: Path, timeout=LAUNCH_TIMEOUT_S):
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"launcher still running after {timeout}s:\n{log.read_text()[-3000:]}")
    assert code == 0, f"launcher exited with {code}:\n{log.read_text()[-3000:]}"


def run(command, log: Path):
    finish(start(command, log), log)


def loss_rows(save_dir) -> list[tuple[int, float]]:
    """(step, loss) rows of the csv monitor, in write order (a resumed run appends)."""
    path = Path(save_dir) / "metrics" / "mtraining" / "Train_mtraining_loss.csv"
    if not path.exists():
        return []
    with path.open() as f:
        return [(int(row[0]), float(row[1])) for row in csv.reader(f) if row and row[0] != "step"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cpu_op):  # the op is built before the launched ranks start
    """An uninterrupted ``deepspeed --num_gpus 2`` run: {step: loss}."""
    save_dir = tmp_path_factory.mktemp("reference")
    run(train_command(save_dir, "--num_gpus", "2", "--master_port", str(free_port())), save_dir / "log.txt")
    rows = loss_rows(save_dir)
    assert [step for step, _ in rows] == list(range(1, STEPS + 1))
    assert (save_dir / "latest").read_text().strip() == f"step{STEPS}"
    return dict(rows), save_dir


def test_num_gpus_zero2_offload_trains_and_the_loss_falls(reference):
    losses, save_dir = reference
    first, last = [losses[s] for s in range(1, 6)], [losses[s] for s in range(STEPS - 4, STEPS + 1)]
    assert sum(last) / 5 < sum(first) / 5 - 0.3, losses
    log = (save_dir / "log.txt").read_text()
    assert "2 ranks = 1 data-parallel x 2 sequence-parallel, flat ring" in log
    assert f"checkpoint: {save_dir}" in log and f"metrics:    {save_dir / 'metrics' / 'mtraining'}" in log


def test_sigkill_then_resume_matches_the_uninterrupted_run_bit_for_bit(reference, tmp_path):
    losses, _ = reference
    log = tmp_path / "killed.txt"
    process = start(train_command(tmp_path, "--num_gpus", "2", "--master_port", str(free_port())), log)
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while max((step for step, _ in loss_rows(tmp_path)), default=0) < KILL_AFTER:
        assert process.poll() is None, f"run ended before step {KILL_AFTER}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "run too slow to reach the kill point"
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    killed_at = max(step for step, _ in loss_rows(tmp_path))
    resumed_from = int((tmp_path / "latest").read_text().strip().removeprefix("step"))
    assert KILL_AFTER - SAVE_INTERVAL < resumed_from <= killed_at < STEPS

    run(train_command(tmp_path, "--num_gpus", "2", "--master_port", str(free_port()), extra=["--resume"]),
        tmp_path / "resumed.txt")
    rows = loss_rows(tmp_path)
    assert [step for step, _ in rows[killed_at:]] == list(range(resumed_from + 1, STEPS + 1))
    for step, loss in rows:  # before the kill, after the resume: every value exactly equal
        assert loss == losses[step], f"step {step}: {loss!r} != uninterrupted {losses[step]!r}"
    assert f"resumed from {tmp_path} at step {resumed_from}" in (tmp_path / "resumed.txt").read_text()


def test_hostfile_two_fake_nodes_hierarchical_ring(reference, tmp_path):
    """Two ``--no_ssh --node_rank`` launchers on one machine: one rank per "node", so
    ring "auto" picks the hierarchical ring (2 nodes x 1); losses equal the flat run's."""
    losses, _ = reference
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    config = json.loads(CONFIG.read_text())
    config["mtraining"]["ring"] = "auto"
    config_path = tmp_path / "auto_ring.json"
    config_path.write_text(json.dumps(config))
    port = str(free_port())
    nodes = []
    for node in (0, 1):
        command = train_command(tmp_path, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node),
                                "--master_addr", "127.0.0.1", "--master_port", port, steps=4, config=config_path)
        nodes.append((start(command, tmp_path / f"node{node}.txt"), tmp_path / f"node{node}.txt"))
    for process, log in nodes:
        finish(process, log)
    assert "hierarchical (2 nodes x 1) ring" in (tmp_path / "node0.txt").read_text()
    for step, loss in loss_rows(tmp_path):
        assert loss == pytest.approx(losses[step], rel=1e-6), step


def test_openmpi_launcher(reference, tmp_path):
    """``--launcher openmpi``: mpirun starts the ranks, mpi4py tells DeepSpeed who is who."""
    losses, _ = reference
    if shutil.which("mpirun") is None:
        pytest.skip("Open MPI is not installed: apt-get install -y openmpi-bin libopenmpi-dev")
    pytest.importorskip("mpi4py", reason="mpi4py is not installed: pip install mpi4py")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    command = train_command(tmp_path, "--launcher", "openmpi", "--force_multi", "--no_ssh_check",
                            "--hostfile", str(hostfile), "--master_addr", "127.0.0.1",
                            "--master_port", str(free_port()), "--launcher_args", MPI_ARGS, steps=3,
                            extra=["--no_progress"])
    run(command, tmp_path / "mpi.txt")
    rows = loss_rows(tmp_path)
    assert [step for step, _ in rows] == [1, 2, 3]
    assert "mpirun" in (tmp_path / "mpi.txt").read_text()
    for step, loss in rows:
        assert loss == pytest.approx(losses[step], rel=1e-6), step
