"""docs/CONFIG.md's key tables are generated from the config dataclasses, with the defaults that
``parse_run_config`` really gives (``python -m ds_mtraining.tools.config_doc`` writes them)."""
import json
import re
from dataclasses import fields

from ds_mtraining.tools import config_doc
from ds_mtraining.training.run_config import INPUT_KEYS, RunConfig, parse_run_config


def rows() -> dict:
    """key -> (left out, text) of the generated tables, by dotted name."""
    found, section = {}, ""
    for line in config_doc.CONFIG_MD.read_text().splitlines():
        heading = re.match(r"### `mtraining(?:\.(\w+))?`", line)
        if heading:
            section = f"{heading[1]}." if heading[1] else ""
        cells = re.match(r"\| `(\w+)` \| (.*?) \| (.*) \|$", line)
        if cells:
            found[section + cells[1]] = (cells[2], cells[3])
    return found


def test_config_md_is_what_the_generator_writes():
    text = config_doc.CONFIG_MD.read_text()
    assert config_doc.render(text) == text, "run python -m ds_mtraining.tools.config_doc"


def test_check_fails_on_a_file_out_of_step(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "CONFIG.md"
    stale.write_text(config_doc.CONFIG_MD.read_text().replace("`\"bytes\"`", "`\"words\"`"))
    monkeypatch.setattr(config_doc, "CONFIG_MD", stale)
    assert config_doc.main(["--check"]) == 1 and "not in step" in capsys.readouterr().err
    assert config_doc.main([]) == 0 and config_doc.main(["--check"]) == 0


def test_every_key_with_its_real_default():
    table = rows()
    assert set(table) >= {f.name for f in fields(RunConfig)} | set(INPUT_KEYS)
    run = parse_run_config({"seq_len": 1024}, 1).to_dict()  # every key left out but the required one
    assert table["seq_len"][0] == "*required*"
    for key in ("tokenizer", "data", "loss_chunk_tokens", "attention", "liger", "keep_attention_output"):
        assert json.loads(table[key][0].strip("`")) == run[key], key
    for key in ("last_q", "block_size", "max_slash_diagonals"):
        assert json.loads(table[f"sparse.{key}"][0].strip("`")) == run["sparse"][key], key
    assert json.loads(table["memory.host_reserve_gib"][0].strip("`")) == run["memory"]["host_reserve_gib"]
    # defaults that depend on the run are not shown as one value: document masking is on for the
    # stdlib data of one rank, off for random tokens, and the text says so
    assert run["document_masking"] is True
    assert parse_run_config({"seq_len": 1024, "data": {"source": "random"}}, 1).document_masking is False
    for key in ("document_masking", "sequence_parallel_size"):
        assert table[key][0].startswith("*computed") and "Left out" in table[key][1], key
