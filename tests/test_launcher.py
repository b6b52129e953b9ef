"""The training entry point under the real ``deepspeed`` launcher (2 CPU ranks, gloo, ZeRO-2 with
CPU optimizer offload, sparse ring): trains, survives SIGKILL + --resume bit for bit, and runs
from a hostfile of two fake nodes and through Open MPI. Each launch costs ~20-30 s of CPU here (the
imports of the launcher, launch and rank processes), so the runs are few and tiny (the demo config
reading one document of the stdlib corpus, not all ~30 MB), and the hostfile and Open MPI runs start
together with the reference run. The per-step losses come from DeepSpeed's csv monitor (exact
float repr).
"""
import csv
import importlib
import json
import os
import shutil
import subprocess
import signal
import time
from pathlib import Path

import pytest

from helpers import REPO, environment, finish, run_to_end, start

from ds_mtraining.distributed import free_port

pytestmark = pytest.mark.slow

DEMO_CONFIG = REPO / "ds_configs" / "cpu_demo.json"
STEPS, SAVE_INTERVAL, KILL_AFTER = 20, 5, 12
LAUNCH_TIMEOUT_S = 420
MPI_ARGS = "--allow-run-as-root --oversubscribe --mca btl_tcp_if_include lo -x OMP_NUM_THREADS=1"


def train_command(save_dir, config, *launcher_args, steps=STEPS, extra=()) -> list:
    return ["deepspeed", *launcher_args, "--module", "ds_mtraining.train", "--deepspeed_config", str(config),
            "--steps", str(steps), "--save_dir", str(save_dir), "--save_interval", str(SAVE_INTERVAL), *extra]


def run(command, log: Path):
    run_to_end(command, log, LAUNCH_TIMEOUT_S)


def demo_config(directory: Path, **mtraining) -> Path:
    """cpu_demo.json reading only the first stdlib document (256 samples of 1024 tokens, more
    than the runs use), with ``mtraining`` overrides, written under ``directory``."""
    config = json.loads(DEMO_CONFIG.read_text())
    config["mtraining"]["data"] = {"source": "stdlib", "max_documents": 1}
    config["mtraining"].update(mtraining)
    path = directory / "config.json"
    path.write_text(json.dumps(config))
    return path


def loss_rows(save_dir) -> list[tuple[int, float]]:
    """(step, loss) rows of the csv monitor, in write order (a resumed run appends)."""
    path = Path(save_dir) / "metrics" / "mtraining" / "Train_mtraining_loss.csv"
    if not path.exists():
        return []
    with path.open() as f:
        return [(int(row[0]), float(row[1])) for row in csv.reader(f) if row and row[0] != "step"]


def openmpi_missing() -> str | None:
    if shutil.which("mpirun") is None:
        return "Open MPI is not installed: apt-get install -y openmpi-bin libopenmpi-dev"
    try:
        importlib.import_module("mpi4py")
    except ImportError:
        return "mpi4py is not installed: pip install mpi4py"
    return None


@pytest.fixture(scope="module")
def side_runs(tmp_path_factory, cpu_op):  # the op is built before the launched ranks start
    """The hostfile (two fake nodes, ring "auto") and Open MPI runs, launched at once, beside the
    reference run: they need the reference's losses only to compare at the end, and on 2 cores
    concurrent launches overlap each other's start-up. {name: (save_dir, [(process, log)])};
    whatever still runs at the end is killed."""
    runs = {}
    save_dir = tmp_path_factory.mktemp("hostfile")
    hostfile = save_dir / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    config, port = demo_config(save_dir, ring="auto"), str(free_port())
    runs["hostfile"] = save_dir, [
        (start(train_command(save_dir, config, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node),
                             "--master_addr", "127.0.0.1", "--master_port", port, steps=4), log), log)
        for node, log in ((0, save_dir / "node0.txt"), (1, save_dir / "node1.txt"))]
    if openmpi_missing() is None:
        save_dir = tmp_path_factory.mktemp("openmpi")
        hostfile = save_dir / "hostfile"
        hostfile.write_text("localhost slots=2\n")
        command = train_command(save_dir, demo_config(save_dir), "--launcher", "openmpi", "--force_multi",
                                "--no_ssh_check", "--hostfile", str(hostfile), "--master_addr", "127.0.0.1",
                                "--master_port", str(free_port()), "--launcher_args", MPI_ARGS, steps=3,
                                extra=["--no_progress"])
        runs["openmpi"] = save_dir, [(start(command, save_dir / "mpi.txt"), save_dir / "mpi.txt")]
    yield runs
    for _, processes in runs.values():
        for process, _ in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, side_runs):
    """An uninterrupted ``deepspeed --num_gpus 2`` run: {step: loss}."""
    save_dir = tmp_path_factory.mktemp("reference")
    port = free_port()
    run(train_command(save_dir, demo_config(save_dir), "--num_gpus", "2", "--master_port", str(port)),
        save_dir / "log.txt")
    left = list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    assert not left, f"the run left DeepSpeed's shm buffers behind: {left}"
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
    """SIGKILL mid-run; the same command refused; the latest checkpoint's model file truncated
    (as a crash mid-copy leaves it), so that --resume names it and falls back to the tag before;
    the resumed run's losses equal the uninterrupted run's; a user's files beside the run (in the
    metrics folder, in SAVE_DIR) survive --resume and --overwrite."""
    losses, _ = reference
    log = tmp_path / "killed.txt"
    config = demo_config(tmp_path)
    process = start(train_command(tmp_path, config, "--num_gpus", "2", "--master_port", str(free_port())), log)
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while max((step for step, _ in loss_rows(tmp_path)), default=0) < KILL_AFTER:
        assert process.poll() is None, f"run ended before step {KILL_AFTER}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "run too slow to reach the kill point"
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    killed_rows = loss_rows(tmp_path)
    killed_at = len(killed_rows)
    assert [step for step, _ in killed_rows] == list(range(1, killed_at + 1))
    resumed_from = int((tmp_path / "latest").read_text().strip().removeprefix("step"))
    assert KILL_AFTER - SAVE_INTERVAL < resumed_from <= killed_at < STEPS

    # the same command again, without --resume: refused with one line, nothing touched
    refused = subprocess.run(train_command(tmp_path, config, "--num_gpus", "2", "--master_port", str(free_port())),
                             cwd=REPO, env=environment(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    text = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "Traceback" not in text, text[-3000:]
    assert text.count(f"--save_dir {tmp_path} already holds a run (checkpoints up to step{resumed_from} and "
                      f"metrics in ") == 1 and "continue it with --resume, start over with --overwrite" in text, text
    assert loss_rows(tmp_path) == killed_rows

    model_file = tmp_path / f"step{resumed_from}" / "mp_rank_00_model_states.pt"
    size = model_file.stat().st_size
    model_file.write_bytes(model_file.read_bytes()[:size // 2])
    fallback = resumed_from - SAVE_INTERVAL
    mine = {tmp_path / "metrics" / "mtraining" / "notes.csv": "step,mine\n1,2\n", tmp_path / "notes.txt": "mine"}
    for path, text in mine.items():
        path.write_text(text)
    run(train_command(tmp_path, config, "--num_gpus", "2", "--master_port", str(free_port()),
                      extra=["--resume"]), tmp_path / "resumed.txt")
    rows = loss_rows(tmp_path)
    # the resume drops the killed run's rows after its checkpoint: every step once
    assert [step for step, _ in rows] == list(range(1, STEPS + 1))
    for step, loss in killed_rows + rows:  # before the kill, after the resume: every value exactly equal
        assert loss == losses[step], f"step {step}: {loss!r} != uninterrupted {losses[step]!r}"
    text = (tmp_path / "resumed.txt").read_text()
    assert text.count(f"ds_mtraining: --resume: {model_file} is {size // 2} bytes, {size} when saved (truncated or "
                      f"overwritten); resuming from step{fallback}, the newest intact checkpoint\n") == 1, text[-3000:]
    assert f"resumed from {tmp_path} at step {fallback}" in text and "Traceback" not in text, text[-3000:]
    assert all(path.read_text() == text for path, text in mine.items())

    # --overwrite: the run's checkpoints and metrics go first, then a fresh run from step 0
    run(train_command(tmp_path, config, "--num_gpus", "2", "--master_port", str(free_port()), steps=3,
                      extra=["--overwrite"]), tmp_path / "overwritten.txt")
    rows = loss_rows(tmp_path)
    assert [step for step, _ in rows] == [1, 2, 3] and all(loss == losses[step] for step, loss in rows), rows
    assert (tmp_path / "latest").read_text().strip() == "step3"
    assert sorted(p.name for p in tmp_path.glob("step*")) == ["step3"]  # the earlier run's tags are gone
    assert all(path.read_text() == text for path, text in mine.items())  # and nothing else


def test_hostfile_two_fake_nodes_hierarchical_ring(reference, side_runs):
    """Two ``--no_ssh --node_rank`` launchers on one machine: one rank per "node", so
    ring "auto" picks the hierarchical ring (2 nodes x 1); losses equal the flat run's."""
    losses, _ = reference
    save_dir, nodes = side_runs["hostfile"]
    for process, log in nodes:
        finish(process, log, LAUNCH_TIMEOUT_S)
    assert "hierarchical (2 nodes x 1) ring" in (save_dir / "node0.txt").read_text()
    rows = loss_rows(save_dir)
    assert [step for step, _ in rows] == [1, 2, 3, 4]
    for step, loss in rows:
        assert loss == pytest.approx(losses[step], rel=1e-6), step


def test_openmpi_launcher(reference, side_runs):
    """``--launcher openmpi``: mpirun starts the ranks, mpi4py tells DeepSpeed who is who."""
    losses, _ = reference
    if "openmpi" not in side_runs:
        pytest.skip(openmpi_missing())
    save_dir, [(process, log)] = side_runs["openmpi"]
    finish(process, log, LAUNCH_TIMEOUT_S)
    rows = loss_rows(save_dir)
    assert [step for step, _ in rows] == [1, 2, 3]
    assert "mpirun" in log.read_text()
    for step, loss in rows:
        assert loss == pytest.approx(losses[step], rel=1e-6), step
