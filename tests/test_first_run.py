"""A newcomer's first run: where the demo's ranks go (by GPU count, faked), the demo script's
first and last lines (a fake ``deepspeed`` stands in for the launcher), a rank with no GPU, an
earlier run in --save_dir, an empty data file and ``--help``. The real launches (refusal, resume,
--overwrite) are in test_launcher.py."""
import os
import stat
import subprocess
import sys
import types
from pathlib import Path

import pytest

from helpers import REPO, environment

from ds_mtraining.training import ConfigError
from ds_mtraining.training import placement
from ds_mtraining.training.checkpoint import RUN_FILES, claim_save_dir, earlier_run, record_files

DEMO = REPO / "scripts" / "train_demo.sh"


@pytest.mark.parametrize("gpus, accelerator, config", [(0, "cpu", placement.CPU_CONFIG),
                                                       (1, "cpu", placement.CPU_CONFIG),
                                                       (2, "cuda", placement.GPU_CONFIG),
                                                       (8, "cuda", placement.GPU_CONFIG)])
def test_demo_ranks_go_on_gpus_only_where_two_are_usable(monkeypatch, capsys, tmp_path, gpus, accelerator,
                                                        config):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    placement.main([str(tmp_path / "run")])
    assigned = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines())
    assert assigned["DEMO_ACCELERATOR"] == accelerator and assigned["DEMO_CONFIG"] == config
    assert (REPO / config).is_file() and 1024 <= int(assigned["DEMO_PORT"]) < 65536
    line = placement.demo_placement(gpus).line
    assert line.startswith(f"demo: 2 {'GPU' if gpus >= 2 else 'CPU'} ranks")
    assert ("no GPU" in line) == (gpus == 0) and (f"{gpus} GPU, the ring needs 2" in line) == (gpus == 1)


def test_both_demo_configs_are_valid_for_two_ranks():
    from ds_mtraining.training.run_config import load_run_config
    from ds_mtraining.hf import config_head_dim
    from ds_mtraining.ops import CUDA_HEAD_DIMS
    from ds_mtraining.training.model import model_config
    runs = [load_run_config(str(REPO / name), 2)[0] for name in (placement.CPU_CONFIG, placement.GPU_CONFIG)]
    # the same run; only the precision differs, and the model: the GPU's at a head_dim its kernels take
    cpu, gpu = (dict(run.to_dict()) for run in runs)
    assert config_head_dim(model_config(gpu.pop("model"))) in CUDA_HEAD_DIMS
    assert cpu.pop("model")["name_or_path"] == "tiny-qwen2" and cpu == gpu


# DeepSpeed 0.19.8's, after a rank's error
LAUNCHER_LINE = ("[ERROR] [launch.py:259:sigkill_handler] ['python', '-u', '-m', 'ds_mtraining.train', "
                 "'--local_rank=1'] exits with return code = {code}")


def fake_deepspeed(folder: Path, exit_code: int, rank_line: str = "") -> dict:
    """A ``deepspeed`` on PATH that records its arguments and environment, prints ``rank_line``
    and then the launcher's own last line (on failure), and exits with ``exit_code``."""
    record = folder / "record.txt"
    script = folder / "deepspeed"
    script.write_text(f"""#!/usr/bin/env bash
{{ echo "args: $*"; echo "DS_ACCELERATOR=${{DS_ACCELERATOR:-unset}}"; }} > {record}
echo "step 1/30  loss 5.5"
if [ {exit_code} -ne 0 ]; then
  echo "{rank_line}" >&2
  echo "{LAUNCHER_LINE.format(code=exit_code)}" >&2
fi
exit {exit_code}
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return environment(PATH=f"{folder}{os.pathsep}{os.environ['PATH']}", CUDA_VISIBLE_DEVICES="")


RANK_LINE = "ds_mtraining.train: configuration error: the rank's one line"


@pytest.mark.parametrize("exit_code, rank_line, error", [
    (0, "", ""),
    (2, RANK_LINE, RANK_LINE),  # the rank's line alone: not the launcher's after it
    (1, "RuntimeError: a rank's own crash", "RuntimeError: a rank's own crash\ndemo: a rank exited with code 1 and "
                                            "the launcher stopped the others (the output above says why)")],
    ids=["trained", "refused", "crashed"])
def test_demo_script_names_its_ranks_first_and_ends_with_the_rank_line(tmp_path, exit_code, rank_line, error):
    env = fake_deepspeed(tmp_path, exit_code, rank_line)
    done = subprocess.run(["bash", str(DEMO), "--steps", "5"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == exit_code, done.stderr
    out = done.stdout.splitlines()
    assert out[0] == "demo: 2 CPU ranks (gloo, C++ kernels, fp32); no GPU" and "expect index density" in out[1]
    record = (tmp_path / "record.txt").read_text()
    assert "DS_ACCELERATOR=cpu" in record and f"--deepspeed_config {placement.CPU_CONFIG}" in record
    assert "--quiet --num_gpus 2 --master_port" in record and record.splitlines()[0].endswith("--steps 5")
    assert done.stderr == error + "\n" * bool(error)


def test_the_demos_second_run_is_one_line_before_any_launch(tmp_path, monkeypatch):
    """A SAVE_DIR holding a run (as DeepSpeed's save_checkpoint and the csv monitor leave it):
    exactly one line on the terminal, naming --resume, --overwrite and SAVE_DIR, exit 2, and the
    launcher never started; with --resume the launch goes ahead (--overwrite: the same check)."""
    save_dir = tmp_path / "demo"
    (save_dir / "step30").mkdir(parents=True)
    (save_dir / "latest").write_text("step30")
    (save_dir / "metrics" / "mtraining").mkdir(parents=True)
    (save_dir / "metrics" / "mtraining" / "Train_mtraining_loss.csv").write_text("step,loss\n30,4.2\n")
    env = dict(fake_deepspeed(tmp_path, 0), SAVE_DIR=str(save_dir))
    done = subprocess.run(["bash", str(DEMO)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "" and not (tmp_path / "record.txt").exists(), done
    assert done.stderr == (f"demo: {save_dir} already holds a run (checkpoints up to step30 and metrics in "
                           f"{save_dir / 'metrics' / 'mtraining'}); continue it with --resume (e.g. --resume --steps "
                           f"60), start over with --overwrite (deletes them), or set SAVE_DIR=runs/other\n")
    done = subprocess.run(["bash", str(DEMO), "--resume"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stderr == "", done
    assert (tmp_path / "record.txt").read_text().splitlines()[0].endswith(f"--save_dir {save_dir} --save_interval 10 "
                                                                         f"--resume")
    monkeypatch.chdir(REPO)  # (the demo's config, as the script reads it)
    assert placement.earlier_run_line(str(save_dir), placement.CPU_CONFIG, ["--overwrite"]) is None
    assert placement.earlier_run_line(str(save_dir), placement.CPU_CONFIG, ["--save_dir", str(tmp_path)]) is None


def test_a_rank_without_a_gpu_gets_one_line(monkeypatch):
    from ds_mtraining.train import DeviceError, check_local_device
    accelerator = types.SimpleNamespace(device_name=lambda: "cuda", device_count=lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    check_local_device(accelerator)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(DeviceError) as error:
        check_local_device(accelerator)
    assert str(error.value) == ("local rank 1 has no GPU: this node has 1 usable GPU (CUDA_VISIBLE_DEVICES=3); "
                                "launch at most 1 rank per node (--num_gpus 1), or run on CPU ranks with "
                                "DS_ACCELERATOR=cpu")
    check_local_device(types.SimpleNamespace(device_name=lambda: "cpu", device_count=lambda: 0))  # CPU ranks


def test_an_earlier_run_is_refused_and_overwrite_deletes_only_it(tmp_path):
    """What --overwrite deletes is what the run listed in run_files.json (as train.py lists it):
    a file of the user's in the metrics folder or SAVE_DIR stays; a run that lists nothing (an
    earlier version's) is refused with one line, nothing deleted."""
    save, metrics = tmp_path / "run", tmp_path / "run" / "metrics" / "mtraining"
    claim_save_dir(str(save), str(metrics), resume=False, overwrite=False, clear=True)  # nothing there yet
    for tag in ("step10", "step20"):
        (save / tag).mkdir(parents=True)
        (save / tag / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (save / "latest").write_text("step20")
    (save / "zero_to_fp32.py").write_text("")
    metrics.mkdir(parents=True)
    (metrics / "Train_mtraining_loss.csv").write_text("step,loss\n1,5.0\n")
    (save / "notes.txt").write_text("mine")
    (metrics / "notes.csv").write_text("mine")
    with pytest.raises(ConfigError, match=rf"--overwrite: --save_dir .*run holds checkpoints up to step20 and metrics "
                                          rf"in .* that no {RUN_FILES} lists as a run's .*: --overwrite deletes only "
                                          rf"what a run listed; delete them yourself or pass another --save_dir"):
        claim_save_dir(str(save), str(metrics), resume=False, overwrite=True, clear=True)
    assert (save / "step20").is_dir()
    record_files(str(save), ["step10", "step20", "latest", "zero_to_fp32.py", metrics / "Train_mtraining_loss.csv"])
    assert earlier_run(str(save), str(metrics)) == f"checkpoints up to step20 and metrics in {metrics}"
    with pytest.raises(ConfigError, match=r"--save_dir .*run already holds a run \(checkpoints up to step20 "
                                          r"and metrics in .*\); continue it with --resume, start over with "
                                          r"--overwrite \(deletes them\), or pass another --save_dir"):
        claim_save_dir(str(save), str(metrics), resume=False, overwrite=False, clear=True)
    claim_save_dir(str(save), str(metrics), resume=True, overwrite=False, clear=True)  # resume: kept
    claim_save_dir(str(save), str(metrics), resume=False, overwrite=True, clear=False)  # not this process's job
    assert (save / "latest").is_file()
    with pytest.raises(ConfigError, match="pass one of them"):
        claim_save_dir(str(save), str(metrics), resume=True, overwrite=True, clear=True)
    claim_save_dir(str(save), str(metrics), resume=False, overwrite=True, clear=True)
    assert sorted(p.name for p in save.iterdir()) == ["metrics", "notes.txt", RUN_FILES]
    assert [p.name for p in metrics.iterdir()] == ["notes.csv"]
    assert earlier_run(str(save), str(metrics)) is None  # the user's CSV is no run


def test_an_empty_data_file_says_it_is_empty(tmp_path):
    from ds_mtraining.data import DataConfigError, load_documents
    empty, blank = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    empty.write_text("")
    blank.write_text("\n \n")
    with pytest.raises(DataConfigError) as error:
        load_documents({"files": [str(empty), str(blank)]})
    assert str(error.value) == (f"mtraining.data: empty file(s) {empty}, {blank}: put documents in them or "
                                f"remove them")


def test_help_shows_the_launcher_form_and_the_config_keys():
    done = subprocess.run([sys.executable, "-m", "ds_mtraining.train", "--help"], cwd=REPO, env=environment(),
                          capture_output=True, text=True, timeout=120)
    text = " ".join(done.stdout.split())
    assert done.returncode == 0 and text.startswith("usage: deepspeed [--num_gpus N | --hostfile H] --module "
                                                    "ds_mtraining.train")
    from dataclasses import fields
    from ds_mtraining.training.run_config import RunConfig
    assert all(field.name in text for field in fields(RunConfig)) and "docs/CONFIG.md explains each" in text
    for option in ("--seed SEED model initialisation", "--log_interval LOG_INTERVAL log", "--overwrite delete"):
        assert option in text, option
