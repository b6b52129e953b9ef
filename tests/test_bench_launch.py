"""The studies' launch helpers (ds_mtraining.bench.launch) and the quality study's guard
against a reused study folder: no launches, hand-written metric files."""
import argparse

import pytest

from ds_mtraining.bench import launch
from ds_mtraining.bench.quality import Study


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


def test_quality_study_refuses_a_folder_holding_a_study(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.parquet", "heldout.parquet"):
        (data / name).write_text("")
    config = tmp_path / "config.json"
    config.write_text("{}")
    out = tmp_path / "study"
    args = argparse.Namespace(out=str(out), config=str(config), data=str(data))
    Study(args)  # an empty or new folder is fine
    (out / "sparse").mkdir()
    with pytest.raises(FileExistsError, match="already holds a study"):
        Study(args)
