"""ds_mtraining.bench.resilience reads what scripts/resilience_check.sh writes: the summary lines
of device_env.sh's `stage` (its printf format, run here through bash), the notes and the pytest
outcomes, into one result file; a folder that is not the script's is refused with one line."""
import json
import subprocess
from pathlib import Path

import pytest

from ds_mtraining.bench.resilience import main

ROOT = Path(__file__).resolve().parents[1]


def stage_line(name: str, code: int, seconds: int) -> str:
    """The summary line device_env.sh's `stage` records, from its own printf format string."""
    script = (ROOT / "scripts" / "device_env.sh").read_text()
    form = script[script.index("summary+=(\"$(printf '") + len("summary+=(\"$(printf '"):].split("'", 1)[0]
    status = "ok" if code == 0 else f"FAIL:{code}"
    return subprocess.run(["bash", "-c", f"printf '{form}' {name} {status} {seconds} resilience_check.log"],
                          capture_output=True, text=True, check=True).stdout


def test_the_record_of_a_check(tmp_path):
    lines = [stage_line("build", 0, 8), stage_line("timeouts", 1, 71), stage_line("preempt", 0, 88)]
    (tmp_path / "summary.txt").write_text(
        "=== resilience_check (2026-12-06T18:31:04Z, 1 GPU(s), seq_len 131072, 12 layers)\n" + "\n".join(lines) + "\n"
        "preempt: exit 143; stopped by SIGTERM after finishing step 3: saved it in 17.82 s; last checkpoint /x (tag step3)\n"
        "resume: steps [1, 2, 3] against [1, 2, 3]; largest relative difference 1.50e-07\n")
    (tmp_path / "resilience_check.log").write_text("PASSED tests/test_faults.py::test_a[nccl-1]\n"
                                                   "FAILED tests/test_faults.py::test_a[gloo-2] - ValueError\n")
    out = main([str(tmp_path), "--device", "NVIDIA H100 80GB HBM3", "--out", str(tmp_path / "r.json")])
    record = json.loads(out.read_text())
    assert record["params"] == {"utc": "2026-12-06T18:31:04Z", "gpus": 1, "seq_len": 131072, "layers": 12}
    assert record["device"] == "NVIDIA H100 80GB HBM3" and record["command"] == "bash scripts/resilience_check.sh"
    assert record["rows"] == [
        {"stage": "build", "status": "ok", "seconds": 8}, {"stage": "timeouts", "status": "FAIL:1", "seconds": 71},
        {"stage": "preempt", "status": "ok", "seconds": 88},
        {"test": "tests/test_faults.py::test_a[nccl-1]", "outcome": "passed"},
        {"test": "tests/test_faults.py::test_a[gloo-2]", "outcome": "failed"},
        {"preempt_exit": 143, "saved_step": 3, "save_s": 17.82},
        {"resume_steps": "[1, 2, 3]", "reference_steps": "[1, 2, 3]", "max_relative_loss_difference": 1.5e-07}]


def test_a_folder_that_is_not_the_scripts_is_refused(tmp_path):
    (tmp_path / "summary.txt").write_text("something else\n")
    with pytest.raises(ValueError, match=r"summary.txt: no '=== resilience_check \(\.\.\.\)' header"):
        main([str(tmp_path)])
