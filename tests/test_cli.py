"""The training CLI as a user meets it: continued training of a saved HF model (``--model DIR``,
RoPE/context ``config_overrides``, ``--data DIR``, ``--export_hf``), one copy of each message,
the progress bar's width, benchmark output directories, and how a run ends when something goes
wrong (a rank killed, the launcher killed, a bad data folder): one line, within seconds, measured
here (a bad config key: test_training.py). The launches are few (each costs ~15-30 s of start-up on
2 cores), and the two that need no trained run (the killed launcher, the bad data folder) start
together with the training run: on 2 cores concurrent launches overlap each other's start-up."""
import csv
import io
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers import REPO, environment, run_to_end, start, tiny_model

from ds_mtraining.data import DataConfigError, load_documents, stdlib_documents
from ds_mtraining.distributed import free_port
from ds_mtraining.training import ConfigError
from ds_mtraining.training.run_config import load_run_config

DEMO_CONFIG = REPO / "ds_configs" / "cpu_demo.json"
LAUNCH_TIMEOUT_S = 300
EXIT_WITHIN_S = 30
OVERRIDES = {"rope_theta": 2e6, "max_position_embeddings": 4096}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A saved tiny Qwen2 (the "pretrained" model), a folder of two jsonl files, and a DeepSpeed
    JSON continuing the model's training with a longer context (RoPE theta and positions)."""
    root = tmp_path_factory.mktemp("cli")
    tiny_model("qwen2", seed=3, attn="sdpa").save_pretrained(root / "model")
    (root / "data").mkdir()
    documents = stdlib_documents(document_chars=1 << 14, max_documents=24)
    for part in range(2):
        with open(root / "data" / f"part{part}.jsonl", "w") as f:
            for document in documents[part::2]:
                f.write(json.dumps({"text": document["text"]}) + "\n")
    config = json.loads(DEMO_CONFIG.read_text())
    config["mtraining"]["model"] = {"name_or_path": "tiny-qwen2", "config_overrides": OVERRIDES}
    (root / "config.json").write_text(json.dumps(config))
    return root


def demo_config(**mtraining) -> dict:
    config = json.loads(DEMO_CONFIG.read_text())
    config["mtraining"].update(mtraining)
    return config


# ----------------------------------------------------------------------------- quick checks
def test_stripe_block_error_names_its_key():
    with pytest.raises(ConfigError, match=r"^mtraining.stripe_block=96 is unsupported; use one of \[64, 128\]"):
        load_run_config(demo_config(stripe_block=96), 2)


def test_model_dir_loads_weights_with_context_overrides(workspace):
    from ds_mtraining.training.model import build_model
    model_dir = str(workspace / "model")
    run, _ = load_run_config(str(workspace / "config.json"), 2, model=model_dir)  # --model keeps the overrides
    assert run.model == {"name_or_path": model_dir, "config_overrides": OVERRIDES}
    model = build_model(run.model)
    assert model.config.rope_parameters["rope_theta"] == 2e6 and model.config.max_position_embeddings == 4096
    saved = tiny_model("qwen2", seed=3)
    for name, param in saved.named_parameters():
        torch.testing.assert_close(model.get_parameter(name), param, rtol=0, atol=0, msg=name)
    scaling = {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}}
    run, _ = load_run_config(demo_config(model={"name_or_path": model_dir, "config_overrides": scaling}), 2)
    assert build_model(run.model).config.rope_parameters["rope_type"] == "yarn"
    for overrides, message in [
            ({"hidden_size": 128}, r"config_overrides.hidden_size: a pretrained model .* accepts overrides of "
                                   r"\['rope_theta', 'rope_scaling', 'rope_parameters', 'max_position_embeddings'\]"),
            ({"rope_scaling": {"rope_type": "yarn"}}, r"invalid RoPE settings .*factor"),
            ({"rope_thetta": 1.0}, r"config_overrides.rope_thetta: a pretrained model")]:
        with pytest.raises(ConfigError, match=message):
            load_run_config(demo_config(model={"name_or_path": model_dir, "config_overrides": overrides}), 2)
    with pytest.raises(ConfigError, match=r"config_overrides.rope_thetta: Qwen2Config has no such field"):
        load_run_config(demo_config(model={"name_or_path": "tiny-qwen2",
                                           "config_overrides": {"rope_thetta": 1.0}}), 2)


def test_data_folder(workspace, tmp_path):
    run, _ = load_run_config(demo_config(), 2, data=str(workspace / "data"))
    assert run.data["files"] == [str(workspace / "data" / f"part{i}.jsonl") for i in range(2)]
    assert len(load_documents(run.data)) == 24
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^--data .*empty: no arrow/csv/json/parquet files .*point --data at"):
        load_run_config(demo_config(), 2, data=str(tmp_path / "empty"))
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "mixed" / "b.csv").write_text("text\nb\n")
    with pytest.raises(ConfigError, match=r"mixes formats \['csv', 'json'\]"):
        load_run_config(demo_config(), 2, data=str(tmp_path / "mixed"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.jsonl").write_text("not json {\n")
    run, _ = load_run_config(demo_config(), 2, data=str(tmp_path / "bad"))
    with pytest.raises(DataConfigError, match=r"cannot read .*x.jsonl.* as json \(.*\); fix or remove"):
        load_documents(run.data)


def test_progress_bar_shows_every_field_at_120_columns():
    from rich.console import Console
    from ds_mtraining.training.progress import Progress
    out = io.StringIO()
    progress = Progress(100000, 0, enabled=True,
                        console=Console(file=out, width=120, force_terminal=True, color_system=None))
    progress.update(12345, {"loss": 5.5596, "tokens_per_s": 1234567.0, "density": 0.1234, "imbalance": 1.062})
    progress.bar.refresh()
    progress.close()
    lines = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue()).replace("\r", "\n").splitlines()
    last = [line for line in lines if line.strip()][-1]
    for field in ("train", "12345/100000", "loss 5.5596", "tok/s 1234567", "density 0.123", "imbalance 1.062",
                  "-:--:--"):
        assert field in last, (field, last)


def test_benchmarks_write_to_a_fresh_directory(tmp_path, monkeypatch):
    """--out defaults name a new bench_results/<name>-<time>; benchmarks/results/ only if asked."""
    from ds_mtraining.bench import balance, comm, cpu_kernel, fresh_output_dir, kernel
    monkeypatch.chdir(tmp_path)
    for parser in (comm.build_parser(), cpu_kernel.build_parser(), kernel.build_parser()):
        assert "(default: bench_results/" in " ".join(parser.format_help().split())
        assert "benchmarks/results" not in str(parser.get_default("out"))
    assert balance.parse_args([]).out == balance.BALANCE_OUT
    first, second = fresh_output_dir("x"), fresh_output_dir("x")
    assert first != second and first.parent == second.parent == Path("bench_results")
    comm.main(["--nodes", "2", "--per-node", "2"])
    [written] = list(Path("bench_results").glob("comm-*/comm_model.json"))
    assert json.loads(written.read_text())


# ----------------------------------------------------------------------------- launched runs
def launch_command(workspace, *extra, steps=3, save_dir=None, data=None) -> list:
    return ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "--module", "ds_mtraining.train",
            "--deepspeed_config", str(workspace / "config.json"), "--model", str(workspace / "model"),
            "--data", str(data or workspace / "data"), "--steps", str(steps),
            "--save_dir", str(save_dir or workspace / "run"), "--save_interval", "2", *extra]


def launch(workspace, log: Path, *extra, steps=3, save_dir=None, data=None, env=None) -> subprocess.Popen:
    return start(launch_command(workspace, *extra, steps=steps, save_dir=save_dir, data=data), log, env)


def rank_pids(launcher: subprocess.Popen) -> dict[int, int]:
    import psutil
    pids = {}
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            found = re.search(r"--local_rank=(\d+)", " ".join(child.cmdline()))
        except psutil.Error:  # a short-lived child (a rank's own subprocess) gone meanwhile
            continue
        if found:
            pids[int(found.group(1))] = child.pid
    return pids


def wait_for(text: str, log: Path, process: subprocess.Popen):
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while text not in log.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail(f"no {text!r} in the log:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


class Watched:
    """A started launcher waited for in a thread, so that its exit is timed while other tests run."""

    def __init__(self, process: subprocess.Popen, log: Path):
        self.process, self.log, self.started, self.seconds = process, log, time.monotonic(), None
        self.thread = threading.Thread(target=self._wait, daemon=True)
        self.thread.start()

    def _wait(self):
        self.process.wait()
        self.seconds = time.monotonic() - self.started

    def result(self, timeout: float):
        """(returncode, seconds from start to exit); kills its process group after ``timeout``."""
        self.thread.join(timeout)
        if self.thread.is_alive():
            os.killpg(self.process.pid, signal.SIGKILL)
            self.thread.join()
            pytest.fail(f"still running after {timeout}s (killed):\n{self.log.read_text()[-3000:]}")
        return self.process.returncode, self.seconds


def loaded(pid: int, library: str) -> bool:
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def process_state(pid: int) -> str:
    """A live process's scheduler state and kernel wait channel (why it ignores a signal: D =
    uninterruptible sleep) and its threads' states."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        wchan = Path(f"/proc/{pid}/wchan").read_text() or "-"
        threads = sorted(Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()[0]
                         for t in os.listdir(f"/proc/{pid}/task"))
    except OSError as error:
        return f"pid {pid}: {error}"
    return f"pid {pid}: state {state}, wchan {wchan}, thread states {''.join(threads)}"


def kill_launcher_when_ready(process: subprocess.Popen, log: Path, outcome: dict):
    """Waits until the ranks are past DeepSpeed's shm op load (rank 0's note in the log, and each
    rank's process maps the library: a rank killed inside torch's extension load would leave the
    cache's lock file behind), SIGKILLs the launcher and times the ranks' exit, into ``outcome``
    (an exception of this thread goes there too, as ``error``)."""
    try:
        _kill_launcher_when_ready(process, log, outcome)
    except Exception as error:  # noqa: BLE001 - the test reports it
        outcome["error"] = f"the launcher-killing thread failed: {error!r}"


def _kill_launcher_when_ready(process: subprocess.Popen, log: Path, outcome: dict):
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    pids = {}
    while not (len(pids := rank_pids(process)) == 2
               and all(loaded(pid, "deepspeed_shm_comm") for pid in pids.values())):
        if process.poll() is not None or time.monotonic() > deadline:
            outcome["error"] = f"the ranks never got past init_distributed:\n{log.read_text()[-3000:]}"
            return
        time.sleep(0.1)
    killed = time.monotonic()
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    while any(alive(pid) for pid in pids.values()) and time.monotonic() < killed + EXIT_WITHIN_S:
        time.sleep(0.1)
    outcome.update(pids=pids, seconds=time.monotonic() - killed, left=[pid for pid in pids.values() if alive(pid)])
    outcome["left_states"] = [process_state(pid) for pid in outcome["left"]]
    for pid in outcome["left"]:
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def side_launches(workspace, cpu_op, tmp_path_factory):  # the op is built before the launched ranks start
    """Started before the training run, beside it: a run whose ``deepspeed`` launcher is SIGKILLed
    (by a thread) once its ranks are past init_distributed, and a launch with an empty data folder.
    Whatever still runs at the end is killed."""
    root = tmp_path_factory.mktemp("side")
    # data of its own (half the files), so that no datasets cache entry is shared with the training run
    (root / "data").mkdir()
    (root / "data" / "part0.jsonl").write_text((workspace / "data" / "part0.jsonl").read_text())
    log = root / "launcher.txt"
    process = launch(workspace, log, steps=1000, save_dir=root / "run", data=root / "data")
    killed = {"log": log}
    killer = threading.Thread(target=kill_launcher_when_ready, args=(process, log, killed), daemon=True)
    killer.start()
    (root / "empty").mkdir()
    bad_log = root / "bad_data.txt"
    bad_data = Watched(launch(workspace, bad_log, save_dir=root / "bad_run", data=root / "empty"), bad_log)
    yield {"killer": killer, "killed": killed, "bad_data": bad_data}
    for group in (process, bad_data.process):
        if group.poll() is None:
            os.killpg(group.pid, signal.SIGKILL)
    killer.join(timeout=EXIT_WITHIN_S + 5)


@pytest.fixture(scope="module")
def trained(workspace, cpu_op, side_launches):  # the op is built before the launched ranks start
    """3 steps of continued training (checkpoints step2, step3), then the export."""
    log = workspace / "train.txt"
    # in-memory datasets: both ranks tokenize (no cache file), so rank 0 always draws its
    # "tokenizing" bar (with the on-disk cache, rank 1 may finish first and rank 0 load its result)
    env = environment(HF_DATASETS_IN_MEMORY_MAX_SIZE=str(1 << 30))
    run_to_end(launch_command(workspace, "--export_hf", str(workspace / "export")), log, LAUNCH_TIMEOUT_S, env)
    return log.read_text()


@pytest.mark.slow
def test_continued_training_exports_the_trained_model(workspace, trained):
    """The export loads with AutoModelForCausalLM and its logits equal those of the checkpoint's
    fp32 master weights (consolidated independently by DeepSpeed's zero_to_fp32)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM
    exported = AutoModelForCausalLM.from_pretrained(workspace / "export").eval()
    assert exported.config.rope_parameters["rope_theta"] == 2e6 and exported.config.max_position_embeddings == 4096
    state = get_fp32_state_dict_from_zero_checkpoint(str(workspace / "run"), tag="step3")
    reference = type(exported)(exported.config).eval()
    reference.load_state_dict({name.removeprefix("model."): value for name, value in state.items()})
    before = AutoModelForCausalLM.from_pretrained(workspace / "model").eval()
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = exported(ids).logits
        torch.testing.assert_close(logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
        assert (logits - before(ids).logits).abs().max() > 1e-2  # trained, not the input model
    # one copy of each message: rank 0's only. A progress bar counts by its first frame: a slow
    # machine may draw the 100% frame twice (an update and the close), still one bar
    for text, count in (("MTraining: 2 ranks", 1), ("tokenizing:   0%", 1), ("Loading weights:   0%", 1),
                        ("exported:   ", 1), ("next:       ", 1), ("Traceback", 0),
                        ("built successfully", 0), ("FutureWarning", 0), ("before it has started", 0)):
        assert trained.count(text) == count, (text, trained[-3000:])
    # the one-time builds (the CPU op, DeepSpeed's shm op), where this run is the first: said once each
    assert all(trained.count(f"compiling {what}") <= 1 for what in ("the mtraining_cpu op", "DeepSpeed's shm")), \
        trained[-3000:]
    assert "tokenizing: 100%" in trained and "Loading weights: 100%" in trained, trained[-3000:]
    # what comes after an export is its evaluation, of that folder
    assert f"next:       evaluate it: python -m ds_mtraining.eval {workspace / 'export'}; more steps: --resume " \
           f"--steps 6\n" in trained, trained[-3000:]
    # on a machine without a GPU, the memory line names none
    [memory] = [line for line in trained.splitlines() if line.startswith("ds_mtraining: memory: ")]
    assert torch.cuda.is_available() or "GPU" not in memory, memory


@pytest.mark.slow
def test_dead_rank_one_line_and_metrics_after_resume(workspace, trained):
    """Resume from step2 (as if killed after step 3), train, kill -9 rank 1 after step 5: the
    launcher ends within seconds with one line naming rank 1 and the checkpoint (step4), no
    traceback; the metrics CSVs hold one header and each step once."""
    (workspace / "run" / "latest").write_text("step2")
    log = workspace / "dead_rank.txt"
    process = launch(workspace, log, "--resume", steps=1000)
    wait_for("step 5/1000", log, process)
    killed = time.monotonic()
    os.kill(rank_pids(process)[1], signal.SIGKILL)
    try:
        process.wait(timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"still running {EXIT_WITHIN_S}s after rank 1 died:\n{log.read_text()[-3000:]}")
    seconds = time.monotonic() - killed
    text = log.read_text()
    tail = text.splitlines()[-6:]
    assert any(re.search(r"ds_mtraining.train: rank 1 died .* at step [5-9].*last checkpoint .*run \(tag step"
                         r"(4|6|8)\); continue with --resume", line) for line in tail), text[-3000:]
    assert text.count("ds_mtraining.train:") == 1 and "Traceback" not in text, text[-3000:]
    print(f"dead rank: launcher exited {seconds:.1f} s after the kill")
    for path in (workspace / "run" / "metrics" / "mtraining").glob("*.csv"):
        with path.open() as f:
            rows = list(csv.reader(f))
        assert rows[0][0] == "step" and all(row[0] != "step" for row in rows[1:]), path
        steps = [float(row[0]) for row in rows[1:]]
        assert steps == sorted(set(steps)), (path, steps)
    loss = workspace / "run" / "metrics" / "mtraining" / "Train_mtraining_loss.csv"
    assert [int(row[0]) for row in list(csv.reader(loss.open()))[1:6]] == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_killed_launcher_and_bad_data_end_quickly(side_launches):
    """SIGKILL of the ``deepspeed`` command: the ranks see their launcher gone and exit within
    seconds (one line). Meanwhile a bad data folder (through the launcher) stops with one line
    before any engine exists."""
    side_launches["killer"].join(timeout=LAUNCH_TIMEOUT_S + EXIT_WITHIN_S)
    killed = side_launches["killed"]
    assert not side_launches["killer"].is_alive(), "the launcher-killing thread is still waiting"
    assert "error" not in killed, killed.get("error")
    assert sorted(killed["pids"]) == [0, 1], killed["pids"]
    text = killed["log"].read_text()
    assert not killed["left"], (f"ranks still running {EXIT_WITHIN_S}s after the launcher died "
                                f"({'; '.join(killed['left_states'])}):\n{text[-3000:]}")
    assert text.count("ds_mtraining.train: the launcher (pid") == 1 and "Traceback" not in text, text[-3000:]
    print(f"killed launcher: ranks exited {killed['seconds']:.1f} s after the kill")

    bad_data = side_launches["bad_data"]
    code, seconds = bad_data.result(LAUNCH_TIMEOUT_S)
    text = bad_data.log.read_text()
    assert code != 0 and text.count("configuration error") == 1 and "Traceback" not in text, text[-3000:]
    assert "ds_mtraining.train: configuration error: --data " in text and "no arrow/csv/json/parquet files" in text
    print(f"bad data folder: launcher exited {seconds:.1f} s after its start (beside other launches)")
