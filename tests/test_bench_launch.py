"""The studies' launch helpers (ds_mtraining.bench.launch), the studies' guards against a reused
folder (hand-written metric files, no launches) and bench.documents_training end to end on CPU."""
import argparse
import json
import subprocess
import sys

import pytest
from helpers import REPO, environment

from ds_mtraining.bench import documents_training, launch
from ds_mtraining.bench.quality import Study, mode_config
from ds_mtraining.distributed import free_port


def write_metric(run_dir, name, text):
    folder = run_dir / "metrics" / "mtraining"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"Train_mtraining_{name}.csv").write_text(text)


def test_read_metric_joins_a_resumed_run(tmp_path):
    write_metric(tmp_path, "loss", "step,loss\n10,2.5\n20,2.0\nstep,loss\n30,1.5\n")
    steps, values = launch.read_metric(tmp_path, "loss")
    assert steps.tolist() == [10, 20, 30] and values.tolist() == [2.5, 2.0, 1.5]


def test_read_metric_refuses_two_runs_in_one_folder(tmp_path):
    write_metric(tmp_path, "loss", "step,loss\n10,2.5\n20,2.0\nstep,loss\n10,3.0\n20,2.2\n")
    with pytest.raises(ValueError, match="more than one run"):
        launch.read_metric(tmp_path, "loss")


def test_training_command_places_ranks():
    gpus = launch.training_command("c.json", 5, "run", "cuda:0,cuda:1", 29700, 1, 10)
    assert gpus[gpus.index("--include") + 1] == "localhost:0,1" and "--num_gpus" not in gpus
    cpus = launch.training_command("c.json", 5, "run", "cpu,cpu", 29700, 1, 10, export_hf="hf")
    assert cpus[cpus.index("--num_gpus") + 1] == "2" and cpus[-2:] == ["--export_hf", "hf"]
    assert cpus[cpus.index("--log_interval") + 1] == "5"  # never beyond the last step


def test_run_in_lanes_runs_every_item_and_raises_the_first_error():
    done = []
    launch.run_in_lanes([(["a", "b"], "x"), (["c"], "y")], lambda item, device, lane: done.append((item, device, lane)))
    assert sorted(done) == [("a", "x", 0), ("b", "x", 0), ("c", "y", 1)]

    def fail_on_a(item, device, lane):
        if item == "a":
            raise RuntimeError("a failed")
        done.append(item)

    done.clear()
    with pytest.raises(RuntimeError, match="a failed"):
        launch.run_in_lanes([(["a", "b"], "x"), (["c"], "y")], fail_on_a)
    assert done == ["c"]  # lane 0 stopped at its error, lane 1 ran to its end


def study_inputs(tmp_path, config: dict):
    """(corpus folder with empty train/held-out files, config file) for a Study that trains nothing."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.parquet", "heldout.parquet"):
        (data / name).write_text("")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return data, path


def test_quality_study_refuses_a_folder_holding_a_study(tmp_path):
    data, config = study_inputs(tmp_path, {})
    out = tmp_path / "study"
    args = argparse.Namespace(out=str(out), config=str(config), data=str(data), passkey_questions=None)
    Study(args)  # an empty or new folder is fine
    (out / "sparse").mkdir()
    with pytest.raises(FileExistsError, match="already holds a study"):
        Study(args)


def test_quality_study_passkey_questions_reach_every_run_config(tmp_path):
    data, config = study_inputs(tmp_path, {"mtraining": {"sparse": {}, "data": {"source": "stdlib",
                                                                                 "passkey_questions": 8}}})
    for given, expected in ((None, 8), (1, 1)):
        args = argparse.Namespace(out=str(tmp_path / f"study{given}"), config=str(config), data=str(data),
                                  passkey_questions=given)
        study = Study(args)
        for mode in ("dense", "sparse"):
            run = mode_config(study.base, mode, 10, str(data / "train.parquet"))
            assert run["mtraining"]["data"]["passkey_questions"] == expected


def test_documents_training_refuses_a_folder_holding_runs(tmp_path):
    (tmp_path / "no_document_masking").mkdir()
    with pytest.raises(FileExistsError, match="already holds runs"):
        documents_training.train_both({}, 2, ["cpu,cpu"], tmp_path, 1, 29700, 1)


@pytest.mark.slow
@pytest.mark.usefixtures("built_ops")  # built before the launched ranks start
def test_documents_training_end_to_end(tmp_path):
    """Both runs (2 steps each, 2 CPU ranks, one lane) through the launcher: the JSON holds each
    run's logged losses, densities and speeds, and the closing means compare the two. The data
    are short documents (standard-library files cut to 300 characters, three or more per sample),
    so document masking (its masks and its restarted positions) must change the first step's loss."""
    from ds_mtraining.data import stdlib_documents
    texts = [document["text"][:300] for document in stdlib_documents(1, 60)]
    (tmp_path / "short.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    config = json.loads((REPO / "ds_configs" / "cpu_demo_documents.json").read_text())
    config["mtraining"]["data"] = {"files": [str(tmp_path / "short.jsonl")]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    command = [sys.executable, "-m", "ds_mtraining.bench.documents_training", "--config",
               str(tmp_path / "config.json"), "--steps", "2", "--lanes", "cpu,cpu", "--tail", "2",
               "--out", str(tmp_path / "runs"), "--results", str(tmp_path), "--tag", "t",
               "--port", str(free_port())]  # not the fixed default: another run may hold it
    done = subprocess.run(command, cwd=REPO, env=environment(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "documents_t.json").read_text())
    assert set(record["runs"]) == {"document_masking", "no_document_masking"} and (tmp_path / "documents_t.png").is_file()
    for name, run in record["runs"].items():
        assert run["steps"] == [1, 2] and len(run["loss"]) == len(run["density"]) == 2
        saved = json.loads((tmp_path / "runs" / name / "config.json").read_text())
        assert saved["mtraining"]["document_masking"] is (name == "document_masking")
        assert record["tail_mean_loss"][name] == pytest.approx(sum(run["loss"]) / 2)
    assert record["tail_loss_gap"] == pytest.approx(
        record["tail_mean_loss"]["document_masking"] / record["tail_mean_loss"]["no_document_masking"] - 1)
    first = {name: run["loss"][0] for name, run in record["runs"].items()}
    assert first["document_masking"] != first["no_document_masking"], f"document masking changed nothing: {first}"


def test_integration_bench_reads_the_example_log_and_writes_the_ratio(tmp_path, monkeypatch):
    """bench.integration with the launches faked: the example's step lines (9.0/2.0/2.2/2.0 s) give
    the median after one warm-up step, 2.0 s -> 1024 tok/s; train's 1.6 s gives 1280 tok/s; the
    ratio is 0.8. A side that fails leaves the ratio None and records why."""
    from ds_mtraining.bench import e2e, integration

    def example_ran(command, log, env, timeout):
        assert str(integration.EXAMPLE) in command and "--gradient_checkpointing" not in command  # as cpu_demo
        config = json.loads((log.parent / "config.json").read_text())
        assert config["mtraining"]["memory"] == integration.MEMORY_TOOLS_OFF and config["mtraining"]["seq_len"] == 2048
        log.write_text("[launch] spawned\n" + "".join(
            json.dumps({"step": i + 1, "loss": 5.0 - i, "tokens_per_s": 0, "step_s": s}) + "\n"
            for i, s in enumerate([9.0, 2.0, 2.2, 2.0])))

    def train(config, gpus, world, folder, port, args):
        return {"step_s": 1.6, "tokens_per_s": 2048 / 1.6, "losses": [5.0]}

    monkeypatch.setattr(integration, "run_logged", example_ran)
    args = integration.parse_args(["--cpu", "--config", str(REPO / "ds_configs" / "cpu_demo.json"), "--model",
                                   "tiny-qwen2", "--seq_len", "2048", "--world", "2", "--steps", "4", "--out",
                                   str(tmp_path), "--tag", "t"])
    record = integration.compare(args, train)
    assert record["sides"]["own_loop"]["step_s"] == 2.0 and record["own_loop_over_train"] == pytest.approx(0.8)
    assert json.loads((tmp_path / "integration_t.json").read_text())["sides"]["own_loop"]["losses"] == [5, 4, 3, 2]

    def failing(*_args):
        raise e2e.LaunchFailed("timeout", "still running after 540 s")
    record = integration.compare(args, train, failing)
    assert record["own_loop_over_train"] is None and record["sides"]["own_loop"]["failure"] == "timeout"


def test_integration_bench_pins_both_sides_density_as_e2e_does():
    """--density gives the one JSON both launches read the caps of bench.e2e --density."""
    from ds_mtraining.bench import e2e, integration
    base = json.loads((REPO / "ds_configs" / "e2e_zero2_offload_bf16.json").read_text())
    args = integration.parse_args(["--cpu", "--seq_len", "131072", "--density", "0.05", "--out", "unused"])
    sparse = integration.bench_config(base, args)["mtraining"]["sparse"]
    assert sparse == {**base["mtraining"].get("sparse", {}), **e2e.pinned_caps(0.05, 131072, 128, 256)}
    unpinned = integration.bench_config(base, integration.parse_args(["--cpu", "--out", "unused"]))["mtraining"]
    assert unpinned.get("sparse") == base["mtraining"].get("sparse")


def test_integration_bench_keeps_the_steps_of_a_launch_cut_off_by_its_timeout(tmp_path, monkeypatch):
    """A side killed at --timeout after logging steps past the warm-up keeps them, marked cut_off:
    the example's step lines (4.0/2.0/3.0 s: median 2.5 s after the warm-up), train's csv metrics
    (tokens/s 1024 and 512 after a warm-up step: 2 s and 4 s, median 3 s); the ratio is taken.
    Cut off before any timed step, a side fails as a timeout."""
    from ds_mtraining.bench import e2e, integration
    from ds_mtraining.bench.launch import LaunchTimeout, metric_path

    def example_cut_off(command, log, env, timeout):
        log.write_text("".join(json.dumps({"step": i + 1, "loss": 5.0, "tokens_per_s": 0, "step_s": s}) + "\n"
                               for i, s in enumerate([4.0, 2.0, 3.0])))
        raise LaunchTimeout("still running after 9 s (killed)")

    def train_cut_off(config, gpus, world, folder, port, args):
        for name, values in (("tokens_per_s", [100.0, 1024.0, 512.0]), ("loss", [5.0, 4.0, 3.0])):
            path = metric_path(folder / "run", name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"step,{name}\n" + "".join(f"{i + 1},{v}\n" for i, v in enumerate(values)))
        raise e2e.LaunchFailed("timeout", "still running after 9 s (killed)")

    monkeypatch.setattr(integration, "run_logged", example_cut_off)
    monkeypatch.setattr(e2e, "launch", train_cut_off)
    args = integration.parse_args(["--cpu", "--config", str(REPO / "ds_configs" / "cpu_demo.json"), "--model",
                                   "tiny-qwen2", "--seq_len", "2048", "--world", "2", "--steps", "4", "--out",
                                   str(tmp_path), "--tag", "t"])
    record = integration.compare(args)
    train, own = record["sides"]["train"], record["sides"]["own_loop"]
    assert own["step_s"] == pytest.approx(2.5) and own["cut_off"].startswith("still running")
    assert train["step_s"] == pytest.approx(3.0) and train["cut_off"].startswith("still running")
    assert record["own_loop_over_train"] == pytest.approx(3.0 / 2.5)

    def example_cut_off_in_its_warm_up(command, log, env, timeout):
        log.write_text(json.dumps({"step": 1, "loss": 5.0, "tokens_per_s": 0, "step_s": 4.0}) + "\n")
        raise LaunchTimeout("still running after 9 s (killed)")
    monkeypatch.setattr(integration, "run_logged", example_cut_off_in_its_warm_up)
    record = integration.compare(args)
    assert record["sides"]["own_loop"]["failure"] == "timeout" and record["own_loop_over_train"] is None
