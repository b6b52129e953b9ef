"""Checkpoints through ``engine.save_checkpoint`` with the step, the data position and every
rank's RNG states, so that a resumed run's losses equal an uninterrupted run's.

* A tag becomes ``latest`` only once every rank has written it: DeepSpeed saves it without
  ``latest`` (its own writes ``latest`` on rank 0 before the other ranks' shards are done), then
  rank 0 writes the tag's ``manifest.json`` (every file and its size) and replaces ``latest``.
  A full disk during a save is named as such (:class:`DiskFull`) and the partial tag removed.
* ``--resume`` loads the newest intact tag, from ``latest`` back: a tag without a manifest, with a
  file missing or of another size, or with a file that torch's weights-only unpickler refuses is
  named (file, reason) in one line and the next older one tried (:func:`pick_tag`).
* Loads run torch's weights-only unpickler (:func:`load_weights_only`), DeepSpeed's included: a
  checkpoint holds tensors, containers and the few DeepSpeed types of :func:`safe_globals`; a
  crafted file is refused, never run.
* ``SAVE_DIR/run_files.json`` lists what the run wrote (tags, ``latest``, DeepSpeed's scripts,
  metrics CSVs, its JSON reports): ``--overwrite`` deletes those and ``--resume`` trims those CSVs,
  nothing else of the folder (:func:`record_files`).
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sys
import time
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist

from ..record import write_json
from . import MTRAINING_KEY, ConfigError
from .run_config import RunConfig

TAG = re.compile(r"step(\d+)")  # the tags save_checkpoint writes
DEEPSPEED_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # copied beside the tags by save_checkpoint
MANIFEST = "manifest.json"  # in a tag: written once every rank's files are, {"files": {name: bytes}}
RUN_FILES = "run_files.json"  # in SAVE_DIR: {"files": [paths relative to SAVE_DIR]} of what the run wrote
FULL_BYTES = 64 << 20  # a save that fails with less than this left on its disk failed for the full disk


class DiskFull(OSError):
    """A checkpoint save ran out of disk; the message is its one line."""


def safe_globals() -> list:
    """The DeepSpeed types a ZeRO checkpoint holds besides tensors and containers (its optimizer
    shards' fragment addresses, loss scaler and ZeRO stage), allowed to torch's weights-only unpickler."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [fragment_address, LossScaler, DynamicLossScaler, ZeroStageEnum]


def load_weights_only(path, map_location=None, mmap: bool = False):
    """``torch.load`` through torch's weights-only unpickler with :func:`safe_globals` (the load
    DeepSpeed's checkpoint engine runs on ``--resume``, and ``bench.recall``'s)."""
    with torch.serialization.safe_globals(safe_globals()):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


def refusal_reason(error: Exception) -> str:
    """Why a checkpoint file did not load, in a few words."""
    text = str(error)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return (f"it holds {found[1]}, which is neither a tensor nor a DeepSpeed state: refused by torch's "
                f"weights-only unpickler, nothing of it run")
    return f"{type(error).__name__}: {(text.strip().splitlines() or ['?'])[0][:200]}"


def damage(save_dir: str, tag: str) -> str | None:
    """Why ``tag`` cannot be resumed from (a file and the reason), or None: its manifest lists
    every file at its saved size, and each ``.pt`` opens with the weights-only unpickler (memory-
    mapped: the pickles are read, the tensors' bytes are not)."""
    folder = Path(save_dir) / tag
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{folder} has no {MANIFEST} (its save did not complete)"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} is {path.stat().st_size} bytes, {size} when saved (truncated or overwritten)"
        if path.suffix == ".pt":
            try:
                load_weights_only(path, "cpu", mmap=zipfile.is_zipfile(path))
            except Exception as error:  # noqa: BLE001 - any failure makes the tag unusable: named
                return f"{path} does not load ({refusal_reason(error)})"
    return None


def tag_step(tag: str) -> int:
    return int(TAG.fullmatch(tag)[1])


def pick_tag(save_dir: str) -> tuple[str | None, list[str]]:
    """The newest intact tag, from the one ``latest`` names back to older ones (all of them when
    ``latest`` names none), and why each newer one was passed over."""
    root = Path(save_dir)
    tags = sorted((p.name for p in root.iterdir() if p.is_dir() and TAG.fullmatch(p.name)), key=tag_step,
                  reverse=True) if root.is_dir() else []
    latest = root / "latest"
    named = latest.read_text().strip() if latest.is_file() else None
    passed = []
    if named is not None and named not in tags:
        passed.append(f"{latest} names {named[:40]!r}, no checkpoint of this folder")
    candidates = [t for t in tags if tag_step(t) <= tag_step(named)] if named in tags else tags
    for tag in candidates:
        reason = damage(save_dir, tag)
        if reason is None:
            return tag, passed
        passed.append(reason)
    return None, passed


def write_atomically(path: Path, text: str):
    """``path`` holds ``text`` or what it held before, never part of it (the ``latest`` file's tag;
    JSON files go through :func:`ds_mtraining.record.write_json`)."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def record_files(save_dir: str, paths):
    """Adds ``paths`` (files or folders, relative to ``save_dir`` or absolute) to the run's list
    of what it wrote (rank 0's job)."""
    listed = _listed_names(save_dir) or []
    names = sorted(set(listed) | {os.path.relpath(os.path.join(save_dir, p), save_dir) for p in paths})
    if names != sorted(listed):
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        write_json(Path(save_dir) / RUN_FILES, {"files": names})


def _listed_names(save_dir: str) -> list[str] | None:
    """The run's list, None when ``save_dir`` has none (no run, or one of an earlier ds_mtraining)."""
    try:
        return list(json.loads((Path(save_dir) / RUN_FILES).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def listed_files(save_dir: str) -> list[Path]:
    """What the run in ``save_dir`` wrote (:func:`record_files`), as absolute paths."""
    return [Path(os.path.abspath(os.path.join(save_dir, name))) for name in _listed_names(save_dir) or []]


def earlier_run(save_dir: str, metrics_dir: str | None) -> str | None:
    """What an earlier run left in ``save_dir`` (its latest checkpoint, metrics), or None."""
    root = Path(save_dir)
    found = []
    latest = root / "latest"
    if latest.is_file():
        found.append(f"checkpoints up to {latest.read_text().strip()}")
    elif root.is_dir() and any(TAG.fullmatch(p.name) for p in root.iterdir() if p.is_dir()):
        found.append("checkpoints")
    listed = _listed_names(save_dir)
    if listed is not None:  # the run's own metrics files (a CSV of the user's is no run)
        metrics = any(p.suffix == ".csv" and p.is_file() for p in listed_files(save_dir))
    else:  # no list: anything a run of an earlier ds_mtraining may have left
        metrics = bool(metrics_dir and Path(metrics_dir).is_dir() and any(Path(metrics_dir).glob("*.csv")))
    if metrics:
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
    if _listed_names(save_dir) is None:
        raise ConfigError(f"--overwrite: --save_dir {save_dir} holds {found} that no {RUN_FILES} lists as a run's "
                          f"(a run of an earlier ds_mtraining, or files of yours): --overwrite deletes only what a "
                          f"run listed; delete them yourself or pass another --save_dir")
    if clear:
        for path in listed_files(save_dir):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        write_json(Path(save_dir) / RUN_FILES, {"files": []})  # a run's folder, emptied


def rng_states() -> dict:
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict):
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_checkpoint(engine, save_dir: str, step: int, data_position: int, run: RunConfig) -> float:
    """``engine.save_checkpoint`` with the data position and every rank's RNG states, made
    ``latest`` once complete (module docstring); returns its seconds."""
    started = time.perf_counter()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rng_states())
    client_state = {"step": step, "data_position": data_position, "rng_states": gathered,
                    "mtraining": run.to_dict()}
    root, tag = Path(save_dir), f"step{step}"
    try:
        engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
        if dist.get_rank() == 0:  # every rank is past the save's closing barrier: the tag is whole
            folder = root / tag
            files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
                     if p.is_file() and p.name != MANIFEST}
            write_json(folder / MANIFEST, {"files": files})
            write_atomically(root / "latest", tag)
            record_files(save_dir, [tag, "latest", *(s for s in DEEPSPEED_SCRIPTS if (root / s).exists())])
    except Exception as error:
        free = shutil.disk_usage(root).free if root.is_dir() else FULL_BYTES
        if getattr(error, "errno", None) != errno.ENOSPC and free >= FULL_BYTES:
            raise
        shutil.rmtree(root / tag, ignore_errors=True)
        raise DiskFull(f"the disk of {root.resolve()} is full ({free >> 20} MiB left) while saving step {step}: "
                       f"the partial tag {tag} was removed; free space") from None
    return time.perf_counter() - started


def resume_checkpoint(engine, save_dir: str, run: RunConfig) -> tuple[int, int]:
    """Loads the newest intact checkpoint of ``save_dir`` (:func:`pick_tag`, decided by rank 0)
    with the weights-only unpickler; returns (step, data position)."""
    decision = [pick_tag(save_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(decision, src=0)
    tag, passed = decision[0]
    if tag is None:
        found = f": {'; '.join(passed)}" if passed else " (no 'latest' file, no step<N> folder)"
        raise ConfigError(f"--resume: no intact checkpoint in --save_dir {save_dir}{found}; train without "
                          f"--resume (--overwrite) or point --save_dir at a run")
    if passed and dist.get_rank() == 0:
        print(f"ds_mtraining: --resume: {'; '.join(passed)}; resuming from {tag}, the newest intact checkpoint",
              file=sys.stderr, flush=True)
    engine.checkpoint_engine.load = load_weights_only
    _, client_state = engine.load_checkpoint(save_dir, tag=tag)
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


def csv_monitor(engine):
    """DeepSpeed's csv monitor where it writes (rank 0, enabled), else None."""
    monitor = getattr(getattr(engine, "monitor", None), "csv_monitor", None)
    if monitor is None or not monitor.enabled or dist.get_rank() != 0 or not monitor.log_dir:
        return None
    return monitor


def record_metrics(engine, save_dir: str):
    """Lists the csv monitor's files so far among the run's (rank 0; once per logged step)."""
    monitor = csv_monitor(engine)
    if monitor is not None:
        record_files(save_dir, [Path(monitor.log_dir) / f"{name}.csv" for name in monitor.filenames])


def continue_metrics(engine, save_dir: str, step: int):
    """After a resume: the csv monitor's files that the run listed keep one header and lose the
    rows written after the checkpoint (a killed run logs steps that the resumed run logs again);
    later rows are appended without a second header. MTraining's files count optimizer steps,
    DeepSpeed's own (``Train_Samples_*``) count samples. Other files of the folder are not touched."""
    monitor = csv_monitor(engine)
    if monitor is None:
        return
    listed = set(listed_files(save_dir))
    for path in sorted(Path(monitor.log_dir).glob("*.csv")):
        if Path(os.path.abspath(path)) not in listed:
            continue
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
