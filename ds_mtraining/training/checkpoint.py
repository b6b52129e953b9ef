"""Checkpoints through ``engine.save_checkpoint`` with the step, the data position and every
rank's RNG states, so that a resumed run's losses equal an uninterrupted run's."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from . import MTRAINING_KEY, ConfigError
from .run_config import RunConfig

TAG = re.compile(r"step\d+")  # the tags save_checkpoint writes
DEEPSPEED_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # copied beside the tags by save_checkpoint


def earlier_run(save_dir: str, metrics_dir: str | None) -> str | None:
    """What an earlier run left in ``save_dir`` (its latest checkpoint, metrics), or None."""
    root = Path(save_dir)
    found = []
    latest = root / "latest"
    if latest.is_file():
        found.append(f"checkpoints up to {latest.read_text().strip()}")
    elif root.is_dir() and any(TAG.fullmatch(p.name) for p in root.iterdir() if p.is_dir()):
        found.append("checkpoints")
    if metrics_dir and Path(metrics_dir).is_dir() and any(Path(metrics_dir).glob("*.csv")):
        found.append(f"metrics in {metrics_dir}")
    return " and ".join(found) or None


def refusal(where: str, found: str, resume: str, elsewhere: str) -> str:
    """The one line that refuses to train over an earlier run (``found``, from :func:`earlier_run`)."""
    return (f"{where} already holds a run ({found}); continue it with {resume}, start over with --overwrite "
            f"(deletes them), or {elsewhere}")


def claim_save_dir(save_dir: str, metrics_dir: str | None, resume: bool, overwrite: bool, clear: bool):
    """Never trains over an earlier run by accident: a ``save_dir`` holding checkpoints or metrics
    needs ``--resume`` (continue it) or ``--overwrite`` (delete its checkpoints and metrics first,
    done where ``clear``: one process per node, before any process group exists)."""
    if resume and overwrite:
        raise ConfigError("--resume continues the run in --save_dir and --overwrite deletes it; pass one of them")
    found = None if resume else earlier_run(save_dir, metrics_dir)
    if found is None:
        return
    if not overwrite:
        raise ConfigError(refusal(f"--save_dir {save_dir}", found, "--resume", "pass another --save_dir"))
    if clear:
        root = Path(save_dir)
        for path in root.iterdir():
            if path.is_dir() and TAG.fullmatch(path.name):
                shutil.rmtree(path, ignore_errors=True)
            elif path.name == "latest" or path.name in DEEPSPEED_SCRIPTS:
                path.unlink(missing_ok=True)
        for path in Path(metrics_dir).glob("*.csv") if metrics_dir else ():
            path.unlink(missing_ok=True)


def rng_states() -> dict:
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict):
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_checkpoint(engine, save_dir: str, step: int, data_position: int, run: RunConfig):
    """``engine.save_checkpoint`` with the data position and every rank's RNG states."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rng_states())
    client_state = {"step": step, "data_position": data_position, "rng_states": gathered,
                    "mtraining": run.to_dict()}
    engine.save_checkpoint(save_dir, tag=f"step{step}", client_state=client_state)


def resume_checkpoint(engine, save_dir: str, run: RunConfig) -> tuple[int, int]:
    """Loads the latest checkpoint of ``save_dir``; returns (step, data position)."""
    path, client_state = engine.load_checkpoint(save_dir)
    if path is None:
        raise ConfigError(f"--resume: no checkpoint in --save_dir {save_dir} (no 'latest' file); "
                          f"train without --resume first or point --save_dir at a run")
    saved = client_state["mtraining"]
    for key in ("seq_len", "sequence_parallel_size"):
        if saved[key] != getattr(run, key):
            raise ConfigError(f"--resume: the checkpoint was trained with {MTRAINING_KEY}.{key}={saved[key]}, "
                              f"this run has {getattr(run, key)}; resume with the same value")
    states = client_state["rng_states"]
    if len(states) != dist.get_world_size():
        raise ConfigError(f"--resume: the checkpoint has {len(states)} ranks, this run {dist.get_world_size()}; "
                          f"resume with the same number of ranks")
    set_rng_states(states[dist.get_rank()])
    return client_state["step"], client_state["data_position"]


def continue_metrics(engine, step: int):
    """After a resume: the csv monitor's files keep one header and lose the rows written after the
    checkpoint (a killed run logs steps that the resumed run logs again); later rows are appended
    without a second header. MTraining's files count optimizer steps, DeepSpeed's own
    (``Train_Samples_*``) count samples."""
    monitor = getattr(getattr(engine, "monitor", None), "csv_monitor", None)
    if monitor is None or not monitor.enabled or dist.get_rank() != 0 or not monitor.log_dir:
        return
    from pathlib import Path
    for path in sorted(Path(monitor.log_dir).glob("*.csv")):
        limit = step if path.name.startswith("Train_mtraining_") else engine.global_samples
        header, rows = None, []
        for line in path.read_text().splitlines():
            first = line.split(",", 1)[0]
            if first == "step":
                header = header or line
            elif first.strip():
                try:
                    if float(first) <= limit:
                        rows.append(line)
                except ValueError:
                    continue
        path.write_text("\n".join([header or "step,value", *rows]) + "\n")
        if path.stem not in monitor.filenames:
            monitor.filenames.append(path.stem)
