"""A long run's faults, met through the real entry point (``ds_mtraining.train.main``: the
watchdog, its signals, its one line and exit) on 2 gloo ranks forked from the session's
forkserver, so that no launcher start-up is paid: a stuck rank (its run waits out its stall
timeout beside the other tests), SIGTERM (preemption), a NaN loss; every process group's timeout;
and, in one process, a crafted checkpoint refused without running. test_launcher.py has those that
go through the ``deepspeed`` launcher: SIGKILL, a truncated latest checkpoint, a user's files
beside a run; test_launcher_guard.py a preempted rank whose launcher the signal took. Every
multi-process run has a deadline: a hang fails the test."""
import csv
import json
import os
import pickle
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from helpers import REPO

from ds_mtraining.distributed import free_port

DEMO_CONFIG = REPO / "ds_configs" / "cpu_demo.json"
RANKS, DEADLINE_S = 2, 240


def write_config(directory: Path, ds: dict | None = None, **mtraining) -> Path:
    """cpu_demo.json on 512 random tokens per sample (the demo's model, ring, ZeRO-2 + CPU
    offload), with DeepSpeed (``ds``) and ``mtraining`` overrides."""
    config = json.loads(DEMO_CONFIG.read_text())
    config["mtraining"].update(seq_len=512, loss_chunk_tokens=256, data={"source": "random", "samples": 64},
                               **mtraining)
    config.update(ds or {})
    config = {key: value for key, value in config.items() if value is not None}  # None: the key left out
    path = directory / "config.json"
    path.write_text(json.dumps(config))
    return path


def _rank(rank: int, argv: list, env: dict, log: str, hang_at: int | None):
    """One rank: its output to ``log``, then ds_mtraining.train.main (which exits the process)."""
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    descriptor = os.open(log.format(rank=rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    torch.set_num_threads(1)
    if hang_at is not None and rank == 1:
        from ds_mtraining.data import RankBatches
        batch = RankBatches.batch

        def hang(self, position):  # as a read from a file system that stopped answering
            if position == hang_at:
                Path(log.format(rank="hung")).write_text(str(time.time()))
                threading.Event().wait()
            return batch(self, position)
        RankBatches.batch = hang
    from ds_mtraining.train import main
    main(argv)


class Ranks:
    """``ds_mtraining.train`` ARGV on 2 ranks; rank 1 hangs reading micro-batch ``hang_at``."""

    def __init__(self, folder: Path, argv: list, hang_at: int | None = None):
        self.folder = folder
        env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(RANKS),
                   LOCAL_WORLD_SIZE=str(RANKS), OMP_NUM_THREADS="1")
        self.context = mp.start_processes(_rank, args=(argv, env, str(folder / "rank{rank}.log"), hang_at),
                                          nprocs=RANKS, join=False, start_method="forkserver")
        self.pids = [p.pid for p in self.context.processes]

    def wait(self, timeout: float = DEADLINE_S) -> list[int]:
        """Every rank's exit code; a rank still running after ``timeout`` fails the test."""
        deadline = time.monotonic() + timeout
        for process in self.context.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        running = [p for p in self.context.processes if p.is_alive()]
        for process in running:
            process.kill()
        assert not running, f"ranks still running after {timeout} s (a hang):\n" + self.logs()
        return [p.exitcode for p in self.context.processes]

    def log(self, rank) -> str:
        path = self.folder / f"rank{rank}.log"
        return path.read_text() if path.exists() else ""

    def logs(self) -> str:
        return "\n".join(f"--- rank {r}:\n{self.log(r)[-3000:]}" for r in range(RANKS))

    def lines(self) -> list[str]:
        """The ``ds_mtraining.train:`` lines of both ranks."""
        return [line for r in range(RANKS) for line in self.log(r).splitlines()
                if line.startswith("ds_mtraining.train:")]


def train_argv(config: Path, save_dir: Path, steps: int, *extra) -> list:
    return ["--deepspeed_config", str(config), "--steps", str(steps), "--save_dir", str(save_dir),
            "--no_progress", *extra]


def losses(save_dir: Path) -> list[tuple[int, float]]:
    path = save_dir / "metrics" / "mtraining" / "Train_mtraining_loss.csv"
    with path.open() as f:
        return [(int(row[0]), float(row[1])) for row in csv.reader(f) if row and row[0] != "step"]


def tags(save_dir: Path) -> list[str]:
    return sorted(p.name for p in save_dir.glob("step*"))


# ----------------------------------------------------------------------------- a stuck rank
STALL_S = 8


@pytest.fixture(scope="module")
def stuck(tmp_path_factory, built_ops):
    """Rank 1 of a run with stall_timeout_s = STALL_S hangs reading the data of step 3. Started by
    the module's first training run, so that its wait for the stall overlaps the other tests (its
    ranks are idle then); the test at the end of the module checks how it ended."""
    folder = tmp_path_factory.mktemp("stuck")
    run = Ranks(folder, train_argv(write_config(folder, stall_timeout_s=STALL_S), folder / "run", 6), hang_at=2)
    yield run
    for process in run.context.processes:
        if process.is_alive():
            process.kill()


# ----------------------------------------------------------------------------- SIGTERM
STEPS = 6


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, stuck):
    """STEPS uninterrupted steps: [(step, loss)]."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    run = Ranks(folder, train_argv(write_config(folder), folder / "run", STEPS, "--no_checkpoint"))
    assert run.wait() == [0, 0], run.logs()
    return losses(folder / "run")


def test_sigterm_saves_the_step_in_flight_and_resume_continues_it(tmp_path, uninterrupted):
    """SIGTERM to one rank after step 2 (as a scheduler sends before its kill): both ranks finish
    the step in flight, save it (no save was due) and exit 128 + 15 with one line; --resume then
    logs every step once, each loss equal to the uninterrupted run's."""
    config, save_dir = write_config(tmp_path), tmp_path / "run"
    run = Ranks(tmp_path, train_argv(config, save_dir, STEPS))
    deadline = time.monotonic() + DEADLINE_S
    while not (save_dir / "metrics" / "mtraining" / "Train_mtraining_loss.csv").exists() or not losses(save_dir):
        assert time.monotonic() < deadline and all(p.is_alive() for p in run.context.processes), run.logs()
        time.sleep(0.05)
    os.kill(run.pids[1], signal.SIGTERM)
    assert run.wait() == [128 + signal.SIGTERM] * 2, run.logs()
    [stopped] = tags(save_dir)
    step = int(stopped.removeprefix("step"))
    assert 1 <= step < STEPS and (save_dir / "latest").read_text() == stopped
    [line] = run.lines()
    assert line.startswith(f"ds_mtraining.train: stopped by SIGTERM after finishing step {step}: saved it in ")
    assert line.endswith(f" s; last checkpoint {save_dir} (tag {stopped}); continue with --resume"), line

    resumed = Ranks(tmp_path, train_argv(config, save_dir, STEPS, "--resume"))
    assert resumed.wait() == [0, 0], resumed.logs()
    assert losses(save_dir) == uninterrupted, (losses(save_dir), uninterrupted)  # each step once, bit for bit
    print(f"SIGTERM: saved step {step} ({line.split('saved it in ')[1].split(';')[0]})")


# ----------------------------------------------------------------------------- non-finite losses
@pytest.mark.usefixtures("stuck")
def test_a_nan_loss_stops_the_run_and_no_later_checkpoint_is_written(tmp_path):
    """SGD at lr 1e30 sends the weights to ~1e28 in step 1, so step 2's loss is not finite (the
    uninterrupted run would go on to the end, every later step skipped): both ranks exit 1 at step
    2 with one line naming the value and the ranks; step 1's checkpoint is the last."""
    config = write_config(tmp_path, ds={"optimizer": {"type": "SGD", "params": {"lr": 1e30}}, "scheduler": None,
                                        "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0})
    save_dir = tmp_path / "run"
    run = Ranks(tmp_path, train_argv(config, save_dir, 5, "--save_interval", "1"))
    assert run.wait() == [1, 1], run.logs()
    [line] = run.lines()
    assert line.startswith("ds_mtraining.train: non-finite loss (") and " on ranks 0, 1) at step 2; the run stops " \
           "without saving it (no checkpoint after step 1)" in line, line
    assert line.endswith(f"; last checkpoint {save_dir} (tag step1); continue with --resume"), line
    assert tags(save_dir) == ["step1"] and [step for step, _ in losses(save_dir)] == [1]


def test_an_fp16_loss_scaler_out_of_scales_stops_in_one_line(monkeypatch):
    """DeepSpeed's own fp16 scaler overflowing at its minimum scale raises a bare Exception inside
    the step: run_step turns it into NonFinite (the entry point's one line, as for a NaN loss),
    naming the step and the fix; any other error of the step passes unchanged."""
    from types import SimpleNamespace

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    import ds_mtraining.train as train_module
    from ds_mtraining.training.step_checks import NonFinite
    scaler = DynamicLossScaler(init_scale=1.0, scale_window=1000, min_scale=1.0, delayed_shift=1,
                               consecutive_hysteresis=False)
    run = SimpleNamespace(step=6, stats=SimpleNamespace(reset=lambda: None, enabled=False), batches=None,
                          engine=SimpleNamespace(gradient_accumulation_steps=lambda: 1),
                          position=0, offload=None, at=None, args=SimpleNamespace(log_interval=1, profile_step=0))
    monkeypatch.setattr(train_module, "train_step", lambda *args: scaler.update_scale(True))
    with pytest.raises(NonFinite, match=r"^fp16 gradients overflow at the loss scaler's minimum scale "
                                        r"\(fp16.min_loss_scale\) at step 7; the run stops without saving it: train in "
                                        r"bf16 \(\"bf16\": \{\"enabled\": true\} in place of \"fp16\"\), or lower the "
                                        r"learning rate$"):
        train_module.run_step(run)

    def other(*args):
        raise KeyError("a batch")
    monkeypatch.setattr(train_module, "train_step", other)
    with pytest.raises(KeyError, match="a batch"):
        train_module.run_step(run)


# ----------------------------------------------------------------------------- a crafted checkpoint
class Crafted:
    """What a crafted checkpoint holds: unpickling it runs a command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_checkpoint_is_refused_without_running_it(tmp_path):
    """A tag whose model file runs a command when unpickled (the manifest in order): --resume's
    check names the file and the global and passes over the tag, the weights-only load DeepSpeed's
    engine is given refuses it, so does bench.recall's; the command never runs. Loaded the way
    DeepSpeed loads by itself (weights_only=False), it does run."""
    from ds_mtraining.bench.recall import demo_inputs
    from ds_mtraining.training.checkpoint import MANIFEST, load_weights_only, pick_tag
    marker, folder = tmp_path / "ran", tmp_path / "step3"
    folder.mkdir()
    crafted = folder / "mp_rank_00_model_states.pt"
    torch.save({"module": Crafted(marker), "mtraining": {}}, crafted)
    (folder / MANIFEST).write_text(json.dumps({"files": {crafted.name: crafted.stat().st_size}}))
    (tmp_path / "latest").write_text("step3")
    assert pick_tag(str(tmp_path)) == (None, [f"{crafted} does not load (it holds posix.system, which is neither a "
                                               f"tensor nor a DeepSpeed state: refused by torch's weights-only "
                                               f"unpickler, nothing of it run)"])
    with pytest.raises(pickle.UnpicklingError, match="posix.system"):
        load_weights_only(crafted)
    with pytest.raises(pickle.UnpicklingError, match="posix.system"):
        demo_inputs(tmp_path, 256, "cpu")
    assert not marker.exists()
    torch.load(crafted, weights_only=False)
    assert marker.exists()


def test_resume_passes_over_damaged_tags_to_the_newest_intact_one(tmp_path):
    """From the tag ``latest`` names back: one cut short before its manifest, one with a file
    truncated, then an intact one, which is chosen, each passed-over tag named with its reason; a
    newer intact tag than ``latest``'s is not considered. A ``latest`` naming no tag: the newest
    intact tag of the folder."""
    from ds_mtraining.training.checkpoint import MANIFEST, pick_tag
    for step in (5, 10, 15, 20):
        folder = tmp_path / f"step{step}"
        folder.mkdir()
        torch.save({"module": {"weight": torch.full((64,), float(step))}}, folder / "mp_rank_00_model_states.pt")
        if step != 15:  # step15's save never completed
            (folder / MANIFEST).write_text(json.dumps({"files": {"mp_rank_00_model_states.pt": (
                folder / "mp_rank_00_model_states.pt").stat().st_size}}))
    truncated = tmp_path / "step10" / "mp_rank_00_model_states.pt"
    size = truncated.stat().st_size
    truncated.write_bytes(truncated.read_bytes()[:100])
    (tmp_path / "latest").write_text("step15")
    assert pick_tag(str(tmp_path)) == ("step5", [f"{tmp_path / 'step15'} has no {MANIFEST} (its save did not "
                                                 f"complete)", f"{truncated} is 100 bytes, {size} when saved "
                                                 f"(truncated or overwritten)"])
    (tmp_path / "latest").write_text("\x00garbage")
    assert pick_tag(str(tmp_path)) == ("step20", [f"{tmp_path / 'latest'} names '\\x00garbage', no checkpoint of "
                                                  f"this folder"])


# ----------------------------------------------------------------------------- process groups' timeouts
def _group_timeouts(rank: int, world: int, backend: str, port: int, stall_s: float) -> list[float]:
    """The world group as ds_mtraining.train makes it (DeepSpeed's init_distributed), then the run's
    groups with a hierarchical ring of 1-rank nodes: every group's collective timeout, seconds."""
    import deepspeed
    import torch.distributed as dist
    from ds_mtraining.distributed import initialize_groups
    from ds_mtraining.training.heartbeat import group_timeout
    dist.destroy_process_group()  # the test harness's own world, with its own timeout
    os.environ["MASTER_PORT"] = str(port)
    deepspeed.init_distributed(dist_backend=backend, timeout=group_timeout(stall_s))
    groups = initialize_groups(world, "hierarchical", ranks_per_node=1, timeout=group_timeout(stall_s))
    device = torch.device("cuda" if backend == "nccl" else "cpu")
    every = [dist.group.WORLD, groups.sequence_group, groups.data_group, groups.model_group,
             groups.sequence_data_group, groups.hierarchy.inner, groups.hierarchy.outer]
    return [group._get_backend(device).options._timeout.total_seconds() for group in every]


@pytest.mark.parametrize("backend, world", [
    pytest.param("gloo", 2, marks=pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.device_count() < 2,
        reason="DeepSpeed's init_distributed binds rank r to cuda:r where CUDA is visible (CPU machines run it)")),
    pytest.param("nccl", 1, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.usefixtures("built_ops")
def test_every_process_group_of_a_run_times_out_after_the_stall_timeout(backend, world):
    """mtraining.stall_timeout_s reaches every group: the world (DeepSpeed's init_distributed, which
    the project's own groups would not inherit) and each group that initialize_groups creates, the
    hierarchical ring's included; on CPU through gloo, on one GPU through NCCL."""
    from ds_mtraining.distributed import run_on_ranks
    from ds_mtraining.training.heartbeat import COLLECTIVE_GRACE_S
    results = run_on_ranks(_group_timeouts, world, backend, free_port(), 42.0, backend=backend, timeout=DEADLINE_S)
    assert results == [[42.0 + COLLECTIVE_GRACE_S] * 7] * world


# ----------------------------------------------------------------------------- a stuck rank (started by `stuck`)
def test_a_stuck_rank_stops_the_job_with_one_line_naming_it(stuck):
    """Rank 1 stops making progress in step 3 (its data read never returns) while rank 0 waits for
    it in a collective: within stall_timeout_s + 30 s both ranks exit 1, with one line naming rank
    1, its host and pid, the step, the phase and the frame, and rank 1's Python stack in its log."""
    run = stuck
    hung = run.folder / "rankhung.log"
    codes = run.wait()
    assert hung.exists(), "rank 1 never reached the hanging read:\n" + run.logs()
    # from the hang to the line (the logs' last write; the ranks exit right after it)
    seconds = max((run.folder / f"rank{r}.log").stat().st_mtime for r in range(RANKS)) - float(hung.read_text())
    assert codes == [1, 1], run.logs()
    assert seconds < STALL_S + 30, seconds
    [line] = run.lines()
    assert line.startswith(f"ds_mtraining.train: rank 1 (host {os.uname().nodename}, pid {run.pids[1]}) made no "
                           f"progress for "), run.logs()
    assert " s at step 3 (loading data; tests/test_faults.py:" in line and " in hang) while the other ranks " \
           "waited for it (its Python stack is in the log); the job stops; no checkpoint in " in line, line
    stack = run.log(1)
    assert "ds_mtraining: rank 1's Python stack, where it made no progress for " in stack, stack
    assert 'test_faults.py", line ' in stack and " in hang" in stack, stack
    print(f"stuck rank: the line came {seconds:.1f} s after rank 1 hung (stall_timeout_s {STALL_S})")
