"""The one writer of the package's JSON files, and the one schema and naming rule of a result file.

* :func:`write_json`: every JSON file the package writes (run-folder files, manifests, summaries,
  benchmark results) goes through it: ``indent=2``, a trailing newline, written to a temporary file
  in the same folder and ``os.replace``'d over the target, so a crash mid-write leaves the old file
  intact (``tests/test_record.py`` holds the package to it).
* :func:`result_record` / :func:`write_result`: a benchmark's result file is
  ``{"name", "device", "commit", "dirty", "command", "utc", "params", "rows", **extra}``.
* :func:`result_path`: ``benchmarks/results/<name>_<device_tag>_<YYYY-MM-DD>.json``.
* :func:`provenance`: which code a result measured (``commit``, ``dirty``).

Low in the layering (layer 0 of docs/DESIGN.md): it imports nothing of ``ds_mtraining``, and torch
only inside the functions that ask for the device.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

COMMIT_VARIABLE = "DS_MTRAINING_COMMIT"
DIRTY_SUFFIX = "-dirty"  # as `git describe --dirty` marks a tree with changes
ROOT = Path(__file__).resolve().parents[1]  # the checkout holding ds_mtraining/ (a clone, an editable install)
RESULTS = ROOT / "benchmarks" / "results"

_UMASK = os.umask(0o022)  # read once (os.umask can only be read by setting it), then put back
os.umask(_UMASK)


# ---------------------------------------------------------------------- the writer
def write_json(path, payload) -> Path:
    """Write ``payload`` to ``path`` as JSON (``indent=2``, trailing newline), atomically.

    The text is serialised in full first (an unserialisable value raises before anything is
    written), then written to a temporary file in the target's folder, flushed to disk and
    ``os.replace``'d over ``path``: a reader sees the old file or the new one, never half of one,
    and a failure at any point leaves the old file as it was and no temporary file behind. Parent
    folders are created. Returns ``path`` as a :class:`~pathlib.Path`."""
    path = Path(path)
    text = json.dumps(payload, indent=2) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, 0o666 & ~_UMASK)  # mkstemp's 0600 -> what open() would have given
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
    return path


# ---------------------------------------------------------------------- a result's schema
def result_record(name: str, params: dict, rows: list, **extra) -> dict:
    """The one schema of a result file: ``{"name", "device", "commit", "dirty", "command", "utc",
    "params", "rows", **extra}``. ``device`` is the accelerator (``torch.cuda.get_device_name`` of
    the current GPU, or ``"cpu"``; ``extra`` may name it itself, e.g. a launcher that ran on GPUs it
    never opened), ``command`` this process's command line in its module form (``python -m
    ds_mtraining.bench.kernel --seq_len 131072``), ``utc`` the time (ISO 8601, seconds),
    ``commit`` and ``dirty`` from :func:`provenance`."""
    record = {"name": name, "device": extra.pop("device", None) or _device_description(),
              **provenance(), "command": extra.pop("command", None) or _command_line(),
              "utc": _utc_now(), "params": params, "rows": rows}
    clash = sorted(set(extra) & set(record))
    if clash:
        raise ValueError(f"result_record: extra fields {clash} would overwrite the schema's own")
    record.update(extra)
    return record


def write_result(name, params, rows, path=None, **extra) -> Path:
    """:func:`result_record` written with :func:`write_json` to ``path`` (default:
    :func:`result_path` of ``name`` on this device, today)."""
    return write_json(path if path is not None else result_path(name), result_record(name, params, rows, **extra))


def result_path(name: str, device_tag: str | None = None, date: str | None = None, folder=None) -> Path:
    """The one naming rule of ``benchmarks/results/``: ``<folder>/<name>_<device_tag>_<YYYY-MM-DD>.json``.

    ``device_tag``: ``h200``, ``h100``, ``h200x2`` (the GPU model, and the count where more than
    one), ``cpu``; None: :func:`_present_device_tag`. ``date``: today (UTC) when None. ``folder``:
    the checkout's ``benchmarks/results`` when None."""
    device_tag = device_tag or _present_device_tag()
    date = date or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    if not re.fullmatch(r"[a-z0-9]+", device_tag):
        raise ValueError(f"device tag {device_tag!r}: lowercase letters and digits only (h200, h200x2, cpu)")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date):
        raise ValueError(f"date {date!r}: YYYY-MM-DD")
    return Path(folder if folder is not None else RESULTS) / f"{name}_{device_tag}_{date}.json"


def plot_path(result, kind: str) -> Path:
    """A plot beside the result JSON ``result``, named by the same rule with its ``kind`` before the
    device: ``quality_128k_h100_2026-12-07.json``, ``"curves"`` -> ``quality_128k_curves_h100_2026-12-07.png``."""
    parsed = _parse_result_name(Path(result).name)
    if parsed is None:
        raise ValueError(f"{Path(result).name} is not named by result_path's rule (<name>_<device>_<YYYY-MM-DD>.json)")
    name, device_tag, date = parsed
    return Path(result).with_name(f"{name}_{kind}_{device_tag}_{date}.png")


def _parse_result_name(filename: str) -> tuple[str, str, str] | None:
    """``kernel_1m_h200_2026-12-01.json`` -> ``("kernel_1m", "h200", "2026-12-01")``, or None where
    the name does not follow :func:`result_path`'s rule."""
    match = re.fullmatch(r"(\w+?)_([a-z0-9]+)_(\d{4}-\d{2}-\d{2})\.json", filename)
    return match.groups() if match else None


# ---------------------------------------------------------------------- the pieces
def _device_description() -> str:
    """The present accelerator: the current GPU's name, or ``"cpu"``."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _tag_of(device: str, count: int = 1) -> str:
    """A device's short tag: ``"NVIDIA H200"`` -> ``h200``, with ``count`` 2 -> ``h200x2``;
    ``cpu...`` -> ``cpu``."""
    words = device.lower().replace("nvidia", " ").split()
    if not words or words[0].startswith("cpu"):
        return "cpu"
    model = re.sub(r"[^a-z0-9]", "", words[0]) or "gpu"
    return model + (f"x{count}" if count > 1 else "")


def _present_device_tag() -> str:
    """:func:`_tag_of` the visible GPUs (their model, and their count where more than one), or ``cpu``."""
    try:
        import torch
    except ImportError:
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    return _tag_of(torch.cuda.get_device_name(0), torch.cuda.device_count())


def _command_line(argv: list[str] | None = None) -> str:
    """This process's command line, as one would type it: ``python -m <module> ...`` where it runs
    a module (``python -m`` gives ``sys.argv[0]`` as the module's file), ``<script> ...`` else."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return "python"
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if argv[0] == "-c":
        head = ["python"]
    elif spec is not None and spec.name and argv[0].endswith(".py"):
        head = ["python", "-m", spec.name.removesuffix(".__main__")]
    elif argv[0].endswith(".py"):
        head = ["python", argv[0]]
    else:
        head = [Path(argv[0]).name]
    return shlex.join(head + argv[1:])


def _utc_now() -> str:
    """Now, ISO 8601 in UTC to the second: ``2026-12-06T14:03:21+00:00``."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def provenance() -> dict:
    """``{"commit": sha, "dirty": bool}`` of the code this process runs.

    ``DS_MTRAINING_COMMIT=<sha>`` (all 40 digits) names the commit where the checkout's own git
    history is not the code measured (a copy of a working tree sent to another machine): ``dirty``
    is then false, or true when the value ends in ``-dirty`` (``<sha>-dirty``: the copy had changes
    on top of sha). Otherwise ``git rev-parse HEAD`` of the checkout holding this package, and
    whether ``git status --porcelain`` lists anything there (an untracked file counts: it may be
    code the run imported). Both are None where the package is in no checkout of its own (installed
    from a wheel)."""
    given = os.environ.get(COMMIT_VARIABLE)
    if given:
        commit = given.removesuffix(DIRTY_SUFFIX).lower()
        # all 40 digits: a short sha can grow ambiguous, and the copy has no git history to expand it
        if not re.fullmatch(r"[0-9a-f]{40}", commit):
            raise ValueError(f"{COMMIT_VARIABLE}={given!r} must be a commit's full sha (40 hex digits: git rev-parse "
                             f"HEAD), followed by '{DIRTY_SUFFIX}' where the tree had changes on top of it")
        return {"commit": commit, "dirty": given.endswith(DIRTY_SUFFIX)}
    try:
        top, commit = _git("rev-parse", "--show-toplevel", "HEAD").splitlines()
        if Path(top).resolve() != ROOT:  # an installed package inside some other repository
            return {"commit": None, "dirty": None}
        return {"commit": commit, "dirty": bool(_git("status", "--porcelain").strip())}
    except (OSError, subprocess.SubprocessError, ValueError):  # no git, or not a checkout
        return {"commit": None, "dirty": None}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True,
                          timeout=30).stdout
