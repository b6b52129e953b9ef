"""Launching ``ds_mtraining.train`` from a benchmark and reading back what it logged: the
studies and benchmarks (:mod:`.quality`, :mod:`.documents_training`, :mod:`.e2e`) train through
the real launcher path."""
from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

from ..distributed.spawn import free_port, port_taken


def training_command(config: Path, steps: int, save_dir: Path, devices: str, port: int, seed: int,
                     log_interval: int, export_hf: Path | None = None, extra: tuple = ()) -> list[str]:
    """The ``deepspeed`` launcher command that trains ``config`` for ``steps`` steps on
    ``devices`` ('cuda:0', 'cuda:0,cuda:1': those GPUs; 'cpu' or 'cpu,cpu': that many CPU ranks),
    with ``extra`` arguments of ``ds_mtraining.train`` (e.g. ``--no_checkpoint``)."""
    devices_list = devices.split(",")
    placement = ["--num_gpus", str(len(devices_list))]
    if devices.startswith("cuda:"):
        placement = ["--include", "localhost:" + ",".join(d.split(":")[1] for d in devices_list)]
    command = [sys.executable, "-m", "deepspeed.launcher.runner", *placement, "--master_port", str(port),
               "--module", "ds_mtraining.train", "--deepspeed_config", str(config), "--steps", str(steps),
               "--save_dir", str(save_dir), "--seed", str(seed), "--log_interval", str(min(log_interval, steps)),
               "--no_progress", "--overwrite"]  # a measurement is a fresh run; a re-measure replaces it
    if export_hf is not None:
        command += ["--export_hf", str(export_hf)]
    return command + list(extra)


def launcher_env() -> dict:
    """The environment of a launch: the launcher places ranks on GPUs itself (``--include``)."""
    return {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}


class LaunchTimeout(RuntimeError):
    """A command still running after its timeout (its process group was killed)."""


def run_logged(command: list[str], log: Path, env: dict, timeout: float | None = None):
    """Runs ``command`` in its own process group with its output in ``log``. A non-zero exit raises
    RuntimeError with the log's tail; past ``timeout`` seconds (or on an interrupt) the whole group
    (the launcher and its ranks) is killed, and a timeout raises :class:`LaunchTimeout`. A launch
    whose ``--master_port`` was taken meanwhile (EADDRINUSE) runs once more on a fresh port."""
    try:
        _run_logged_once(command, log, env, timeout)
    except RuntimeError as error:
        if isinstance(error, LaunchTimeout) or "--master_port" not in command or not port_taken(log.read_text()):
            raise
        retry = list(command)
        retry[retry.index("--master_port") + 1] = str(free_port())
        _run_logged_once(retry, log, env, timeout)


def _run_logged_once(command: list[str], log: Path, env: dict, timeout: float | None):
    with open(log, "w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except BaseException as stop:  # the timeout, or Ctrl-C: no rank may outlive its launch
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            if isinstance(stop, subprocess.TimeoutExpired):
                raise LaunchTimeout(f"{' '.join(command[:6])} ... still running after {timeout:.0f} s (killed); "
                                    f"log {log}") from None
            raise
    if code != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise RuntimeError(f"{' '.join(command[:6])} ... failed (exit {code}); last lines of {log}:\n{tail}")


def metric_path(run_dir: Path, name: str) -> Path:
    """The csv file of one metric that ``ds_mtraining.train`` logged into ``run_dir``."""
    return run_dir / "metrics" / "mtraining" / f"Train_mtraining_{name}.csv"


def read_metric(run_dir: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of one metric of a training run's csv monitor. A resumed run appends a new
    header and later steps (kept); a header followed by steps that do not continue the earlier
    ones means another run wrote into the same folder: ValueError."""
    path = metric_path(run_dir, name)
    with open(path) as handle:
        rows = list(csv.reader(handle))
    steps, values = [], []
    for row in rows:
        if not row[0].lstrip("-").isdigit():  # a header: the file's first line, or a resumed run's
            continue
        if steps and int(row[0]) <= steps[-1]:
            raise ValueError(f"{path} holds the metrics of more than one run (step {row[0]} after step "
                             f"{steps[-1]}): train into a new folder")
        steps.append(int(row[0]))
        values.append(float(row[1]))
    return np.array(steps), np.array(values)


def run_in_lanes(lanes: list[tuple[list, str]], work):
    """Runs ``work(item, device, lane)`` for the items of each lane in order, the lanes at once
    (``lanes``: [(items, device)], ``lane`` the lane's number); a lane stops at its first error
    and the first error is raised once every lane has ended."""
    errors = []

    def lane(items, device, number):
        try:
            for item in items:
                work(item, device, number)
        except Exception as error:  # noqa: BLE001 - reported after the other lanes end
            errors.append(error)

    threads = [threading.Thread(target=lane, args=(items, device, number))
               for number, (items, device) in enumerate(lanes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
