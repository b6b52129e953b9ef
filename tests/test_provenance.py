"""Every benchmark's JSON names the code it measured: ``commit`` and ``dirty`` from
``record.provenance`` (this checkout's git state, or DS_MTRAINING_COMMIT for a copied tree)."""
import json
import re
import subprocess

import pytest

from helpers import REPO

from ds_mtraining import record as module
from ds_mtraining.bench.comm import main as comm_main
from ds_mtraining.record import COMMIT_VARIABLE, provenance


def git(*args: str, cwd=REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


def test_this_checkout_its_head_and_whether_anything_differs(monkeypatch):
    monkeypatch.delenv(COMMIT_VARIABLE, raising=False)
    assert provenance() == {"commit": git("rev-parse", "HEAD").strip(),
                            "dirty": bool(git("status", "--porcelain").strip())}


def test_a_copied_tree_is_named_by_the_variable(monkeypatch):
    sha = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv(COMMIT_VARIABLE, sha)
    assert provenance() == {"commit": sha, "dirty": False}  # whatever the copy's own git says
    monkeypatch.setenv(COMMIT_VARIABLE, sha.upper() + "-dirty")
    assert provenance() == {"commit": sha, "dirty": True}
    monkeypatch.setenv(COMMIT_VARIABLE, "abcdef1")  # a short sha: the results test wants all 40 digits
    with pytest.raises(ValueError, match=f"{COMMIT_VARIABLE}='abcdef1' must be a commit's full sha"):
        provenance()
    monkeypatch.setenv(COMMIT_VARIABLE, "main")
    with pytest.raises(ValueError, match=f"{COMMIT_VARIABLE}='main' must be a commit's full sha"):
        provenance()


def test_outside_a_checkout_of_its_own_both_are_unknown(monkeypatch, tmp_path):
    monkeypatch.delenv(COMMIT_VARIABLE, raising=False)
    monkeypatch.setattr(module, "ROOT", tmp_path)  # no repository at all
    assert provenance() == {"commit": None, "dirty": None}
    git("init", "-q", cwd=tmp_path)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "other", cwd=tmp_path)
    (tmp_path / "site-packages").mkdir()
    monkeypatch.setattr(module, "ROOT", tmp_path / "site-packages")  # a package installed inside another repo
    assert provenance() == {"commit": None, "dirty": None}


def test_a_benchmark_json_carries_commit_and_dirty(monkeypatch, tmp_path):
    monkeypatch.setenv(COMMIT_VARIABLE, "fedcba9876543210fedcba9876543210fedcba98-dirty")
    comm_main(["--out", str(tmp_path / "comm.json")])
    record = json.loads((tmp_path / "comm.json").read_text())
    assert (record["commit"], record["dirty"]) == ("fedcba9876543210fedcba9876543210fedcba98", True)


def test_every_benchmark_that_writes_json_records_provenance():
    """A module of bench/ or tools/ that writes a JSON file records provenance: through
    ``record.result_record`` / ``write_result`` (whose schema holds commit and dirty) or by calling
    provenance() itself (a static check, so a new benchmark cannot leave it out unnoticed)."""
    writes = re.compile(r"json\.dump\(|write_text\(json\.dumps\(|write_json\(|write_result\(")
    records = re.compile(r"result_record\(|write_result\(|provenance\(\)")
    package = REPO / "ds_mtraining"
    modules = sorted((package / "bench").rglob("*.py")) + sorted((package / "tools").glob("*.py"))
    writers = [path for path in modules if writes.search(path.read_text())]
    assert len(writers) >= 10
    assert [str(p.relative_to(REPO)) for p in writers if not records.search(p.read_text())] == []
