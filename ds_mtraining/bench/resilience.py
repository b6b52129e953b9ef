"""The result file of ``scripts/resilience_check.sh`` (a run that lasts days, on one GPU), read
from the folder it writes (``$OUT``: ``summary.txt``, ``notes.txt``, ``resilience_check.log``).

    python -m ds_mtraining.bench.resilience resilience_out --device "NVIDIA H100 80GB HBM3" \\
        --out benchmarks/results/resilience_h100_2026-12-06.json

Rows: each stage (``ok``/``FAIL:<code>``, seconds), the process-group timeout tests' outcomes,
the preemption (exit code, the step saved, the save's seconds) and the resume (steps compared,
the largest relative loss difference against the uninterrupted run). The script runs this
itself at the end; ``DS_MTRAINING_COMMIT`` names the code the check ran when recording a copy.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from ..record import result_path, result_record, write_json

STAGE = re.compile(r"^(\w+)\s+(ok|FAIL:\d+)\s+(\d+)s\b", re.M)
HEADER = re.compile(r"^=== resilience_check \((\S+), (\d+) GPU\(s\), seq_len (\d+), (\d+) layers\)", re.M)
TEST = re.compile(r"^(PASSED|FAILED|SKIPPED|ERROR) (tests/\S+)", re.M)
PREEMPT = re.compile(r"^preempt: exit (\d+); stopped by SIGTERM after finishing step (\d+): saved it in ([\d.]+) s",
                     re.M)
RESUME = re.compile(r"^resume: steps (\[.*?\]) against (\[.*?\]); largest relative difference (\S+)", re.M)


def read_check(folder: Path) -> tuple[dict, list[dict]]:
    """(params, rows) of a resilience_check output folder."""
    summary = (folder / "summary.txt").read_text()
    log = (folder / "resilience_check.log").read_text() if (folder / "resilience_check.log").is_file() else ""
    header = HEADER.search(summary)
    if header is None:
        raise ValueError(f"{folder / 'summary.txt'}: no '=== resilience_check (...)' header; is it the script's?")
    params = {"utc": header[1], "gpus": int(header[2]), "seq_len": int(header[3]), "layers": int(header[4])}
    rows = [{"stage": name, "status": status, "seconds": int(seconds)} for name, status, seconds in STAGE.findall(summary)]
    rows += [{"test": name, "outcome": outcome.lower()} for outcome, name in TEST.findall(log)]
    if (preempt := PREEMPT.search(summary)) is not None:
        rows.append({"preempt_exit": int(preempt[1]), "saved_step": int(preempt[2]), "save_s": float(preempt[3])})
    if (resume := RESUME.search(summary)) is not None:
        rows.append({"resume_steps": resume[1], "reference_steps": resume[2], "max_relative_loss_difference": float(resume[3])})
    return params, rows


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the script's output folder ($OUT)")
    parser.add_argument("--device", default=None, help="the GPU it ran on (default: this machine's)")
    parser.add_argument("--tag", default=None, help="device tag of the file name (default: this machine's)")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/resilience_<tag>_<date>.json")
    parser.add_argument("--check_command", default="bash scripts/resilience_check.sh",
                        help="the command that ran the check (the record's command)")
    args = parser.parse_args(argv)
    params, rows = read_check(args.folder)
    path = args.out or result_path("resilience", args.tag, params["utc"][:10])
    write_json(path, result_record("resilience", params, rows, device=args.device, command=args.check_command))
    print(f"resilience: {len(rows)} rows in {path}")
    return path


if __name__ == "__main__":
    main()
