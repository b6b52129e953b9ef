"""``ds_mtraining.record``: the one JSON writer (atomic: a crash mid-write leaves the old file and
no temporary one), a result file's one schema and name."""
from __future__ import annotations

import datetime
import json
import os
import re
import sys

import pytest

from helpers import REPO

from ds_mtraining import record
from ds_mtraining.record import result_path, result_record, write_json, write_result

SCHEMA = {"name": str, "device": str, "commit": (str, type(None)), "dirty": (bool, type(None)), "command": str,
          "utc": str, "params": dict, "rows": list}


# ---------------------------------------------------------------------- write_json
def test_write_json_indent_two_trailing_newline_parents_made(tmp_path):
    path = write_json(tmp_path / "a" / "b" / "x.json", {"k": [1, 2]})
    assert path == tmp_path / "a" / "b" / "x.json"
    assert path.read_text() == '{\n  "k": [\n    1,\n    2\n  ]\n}\n'
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~record._UMASK)  # not mkstemp's 0600
    write_json(str(path), [])  # a str path, over an existing file
    assert json.loads(path.read_text()) == [] and os.listdir(path.parent) == ["x.json"]


class Unserialisable:
    pass


def test_a_failed_serialisation_leaves_the_old_file(tmp_path):
    path = write_json(tmp_path / "x.json", {"old": True})
    with pytest.raises(TypeError):  # fails halfway through the payload
        write_json(path, {"a": list(range(1000)), "b": Unserialisable()})
    assert json.loads(path.read_text()) == {"old": True} and os.listdir(tmp_path) == ["x.json"]


@pytest.mark.parametrize("where", ["write", "replace"])
def test_a_crash_mid_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch, where):
    path = write_json(tmp_path / "x.json", {"old": True})

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if where == "replace":
        monkeypatch.setattr(record.os, "replace", crash)
    else:  # the disk fills up after part of the text went to the temporary file
        monkeypatch.setattr(record.os, "fsync", crash)
    with pytest.raises(OSError, match="No space left"):
        write_json(path, {"new": list(range(100))})
    assert json.loads(path.read_text()) == {"old": True} and os.listdir(tmp_path) == ["x.json"]


# ---------------------------------------------------------------------- the schema
def test_result_record_holds_the_schema(monkeypatch):
    monkeypatch.setattr(sys, "argv", [record.__file__.replace("record.py", "bench/kernel.py"), "--seq_len", "131072"])
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", type("Spec", (), {"name": "ds_mtraining.bench.kernel"}),
                        raising=False)
    made = result_record("kernel", {"seq_len": 131072}, [{"ms": 1.5}], speedup=2.0)
    assert list(made)[:8] == list(SCHEMA) and made["speedup"] == 2.0
    for key, kind in SCHEMA.items():
        assert isinstance(made[key], kind), (key, made[key])
    assert made["command"] == "python -m ds_mtraining.bench.kernel --seq_len 131072"
    assert made["device"] == record._device_description()
    assert (made["commit"], made["dirty"]) == tuple(record.provenance().values())
    when = datetime.datetime.fromisoformat(made["utc"])
    assert when.utcoffset() == datetime.timedelta(0)
    assert abs((datetime.datetime.now(datetime.timezone.utc) - when).total_seconds()) < 60
    assert result_record("x", {}, [], device="2x NVIDIA H200", command="bash run.sh")["device"] == "2x NVIDIA H200"
    with pytest.raises(ValueError, match="commit"):
        result_record("x", {}, [], commit="abc")


def test_command_line_forms(monkeypatch):
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", None, raising=False)
    assert record._command_line(["benchmarks/probes/power_probe.py", "--x", "a b"]) == \
        "python benchmarks/probes/power_probe.py --x 'a b'"
    assert record._command_line(["/usr/bin/ds-mtraining", "demo"]) == "ds-mtraining demo"


def test_write_result_round_trips(tmp_path):
    path = write_result("cpu_kernel", {"n": 1}, [{"a": 1}], path=tmp_path / "r.json", note="x")
    read = json.loads(path.read_text())
    assert read == {**read, "name": "cpu_kernel", "params": {"n": 1}, "rows": [{"a": 1}], "note": "x"}


# ---------------------------------------------------------------------- the name
def test_result_path_naming(tmp_path):
    assert result_path("kernel", "h200", "2026-11-29", tmp_path) == tmp_path / "kernel_h200_2026-11-29.json"
    assert result_path("comm_vs_ring", "h200x2", "2026-12-01").relative_to(REPO) \
        .as_posix() == "benchmarks/results/comm_vs_ring_h200x2_2026-12-01.json"
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    assert result_path("x", folder=tmp_path).name == f"x_{record._present_device_tag()}_{today}.json"
    for bad in [("x", "H200", None), ("x", "h200_x2", None), ("x", "cpu", "29-11-2026")]:
        with pytest.raises(ValueError):
            result_path(*bad)
    assert record._tag_of("NVIDIA H200") == "h200" and record._tag_of("NVIDIA H100 80GB HBM3", 2) == "h100x2"
    assert record._tag_of("cpu (x86_64, 2 cores)") == "cpu"


def test_plot_names_follow_the_rule():
    result = result_path("quality_128k", "h100", "2026-12-07")
    assert record.plot_path(result, "curves") == result.with_name("quality_128k_curves_h100_2026-12-07.png")
    with pytest.raises(ValueError):
        record.plot_path(result.with_name("quality_128k.json"), "curves")


def test_the_results_folder_follows_the_rule():
    names = [p.name for p in (REPO / "benchmarks" / "results").glob("*.json")]
    assert names and [n for n in names if record._parse_result_name(n) is None] == []
    for name in names:
        stem, tag, date = record._parse_result_name(name)
        assert result_path(stem, tag, date).name == name


# ---------------------------------------------------------------------- the one writer
WRITES = re.compile(r"json\.dump\(|(?:write_text|\.write|write_atomically)\([^()]*json\.dumps\(")


def json_writers(text: str) -> list[str]:
    """The lines of ``text`` that write JSON by hand: any ``json.dump(`` (to a file), and a
    ``json.dumps(`` handed to a write (``write_text(json.dumps(...))``, ``f.write(json.dumps``,
    ``write_atomically(p, json.dumps``, over several lines too); a ``json.dumps`` printed or logged
    is fine. Each as the line where it starts."""
    lines = text.splitlines()
    return [lines[text.count("\n", 0, found.start())].strip() for found in WRITES.finditer(text)]


def test_the_rule_sees_hand_written_json():
    assert json_writers("json.dump(x, f)\npath.write_text(json.dumps(x, indent=1))\nf.write(json.dumps(x))\n"
                        "write_atomically(folder / M, json.dumps(x))\nprint(json.dumps(row), flush=True)\n"
                        "config = json.loads(json.dumps(base))\nstore.set(k, json.dumps(s))\n"
                        "out.write_text(\n    json.dumps(x))") == \
        ["json.dump(x, f)", "path.write_text(json.dumps(x, indent=1))", "f.write(json.dumps(x))",
         "write_atomically(folder / M, json.dumps(x))", "out.write_text("]


def test_every_json_file_of_the_package_goes_through_record():
    package = REPO / "ds_mtraining"
    found = {str(p.relative_to(REPO)): json_writers(p.read_text()) for p in sorted(package.rglob("*.py"))
             if p.name != "record.py" or p.parent != package}
    assert {path: lines for path, lines in found.items() if lines} == {}
