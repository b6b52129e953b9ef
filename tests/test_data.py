"""Offline long-document data: sources, byte tokenizer, packing with the global shift, striping."""
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_mtraining.data import (ByteTokenizer, DataConfigError, PackedSequences, RankBatches,
                               check_data_spec, load_documents, stdlib_documents, tokenize_documents)
from ds_mtraining.layout import StripedLayout

TEXTS = ["def f():\n    return 1\n" * 40, "héllo wörld — ünïcode\n" * 30, "x = [i for i in range(9)]\n" * 50]
EOS = ByteTokenizer.eos_token_id


def stream_of(texts) -> np.ndarray:
    """The expected token stream, built independently: UTF-8 bytes, EOS after each document."""
    return np.concatenate([np.append(np.frombuffer(t.encode(), np.uint8), EOS) for t in texts]).astype(np.int64)


def packed(texts, seq_len, tmp_path=None):
    """Packed samples of ``texts``, read from a jsonl file under ``tmp_path`` if given."""
    import datasets
    if tmp_path is not None:
        documents = load_documents({"files": [write_jsonl(tmp_path, texts)]})
    else:
        documents = datasets.Dataset.from_list([{"text": t} for t in texts])
    return PackedSequences(tokenize_documents(documents, ByteTokenizer()), seq_len)


def write_jsonl(directory: Path, texts) -> str:
    path = directory / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def test_byte_tokenizer_round_trips_unicode():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(TEXTS[1])
    assert ids.max() < 256 and len(ids) == len(TEXTS[1].encode())
    assert tokenizer.decode(list(ids) + [EOS]) == TEXTS[1]


def test_stdlib_corpus_holds_every_stdlib_file_in_long_documents():
    documents = stdlib_documents(document_chars=1 << 20)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    lines = {line for doc in documents for line in doc["text"].splitlines() if line.startswith("# ")}
    assert all(f"# {path.relative_to(root)}" in lines for path in files)
    assert all(len(doc["text"]) >= 1 << 20 for doc in documents[:-1])
    assert documents[0]["text"].startswith(f"# {files[0].relative_to(root)}\n")
    assert stdlib_documents(document_chars=1 << 20)[5]["text"] == documents[5]["text"]  # deterministic
    # max_documents: the same first documents, without reading the rest; fresh dicts per call
    first = stdlib_documents(document_chars=1 << 20, max_documents=2)
    assert first == documents[:2] and first[0] is not stdlib_documents(1 << 20, max_documents=2)[0]
    assert load_documents({"source": "stdlib", "document_chars": 1 << 20, "max_documents": 2})["text"] == \
        [doc["text"] for doc in documents[:2]]


@pytest.mark.parametrize("seq_len", [64, 100])
def test_packing_shifts_labels_on_the_global_stream(seq_len):
    samples = packed(TEXTS, seq_len)
    stream = stream_of(TEXTS)
    assert len(samples) == (len(stream) - 1) // seq_len
    for i in (0, 1, len(samples) - 1):  # the middle one spans a document boundary
        inputs, labels = samples[i]
        assert inputs.tolist() == stream[i * seq_len:(i + 1) * seq_len].tolist()
        assert labels.tolist() == stream[i * seq_len + 1:(i + 1) * seq_len + 1].tolist()
    with pytest.raises(IndexError):
        samples[len(samples)]


def test_local_files_and_saved_dataset_give_the_same_stream(tmp_path):
    import datasets
    reference = packed(TEXTS, 64)
    from_jsonl = packed(TEXTS, 64, tmp_path)
    parquet = tmp_path / "docs.parquet"
    datasets.Dataset.from_list([{"body": t} for t in TEXTS]).to_parquet(str(parquet))
    from_parquet = load_documents({"files": [str(parquet)], "text_field": "body"})
    datasets.Dataset.from_list([{"text": t} for t in TEXTS]).save_to_disk(str(tmp_path / "saved"))
    from_saved = load_documents({"saved_dataset": str(tmp_path / "saved")})
    for documents in (from_parquet, from_saved):
        samples = PackedSequences(tokenize_documents(documents, ByteTokenizer()), 64)
        assert [samples[i][0].tolist() for i in range(len(samples))] == \
            [reference[i][0].tolist() for i in range(len(reference))]
    assert from_jsonl[3][1].tolist() == reference[3][1].tolist()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_rank_shards_are_stripes_of_the_global_sample(world):
    samples = packed(TEXTS * 4, 256)
    shards = [RankBatches(samples, micro_batch_size=2, sequence_rank=r, sequence_world=world,
                          block_size=64, seed=3).batch(5) for r in range(world)]
    layout = StripedLayout(world, 64)
    ids = RankBatches(samples, 2, block_size=64, seed=3).sample_ids(5)
    expected_inputs = torch.stack([samples[i][0] for i in ids])
    expected_labels = torch.stack([samples[i][1] for i in ids])
    assert torch.equal(layout.unshard([s["input_ids"] for s in shards]), expected_inputs)
    assert torch.equal(layout.unshard([s["labels"] for s in shards]), expected_labels)
    for rank, shard in enumerate(shards):
        block = torch.arange(64)
        assert shard["position_ids"].shape == (2, 256 // world)
        assert torch.equal(shard["position_ids"][0, :64], rank * 64 + block)  # first local block = global block r


def test_data_parallel_replicas_read_disjoint_samples_and_epochs_reshuffle():
    samples = packed(TEXTS * 4, 64)
    replicas = [RankBatches(samples, 2, data_rank=d, data_world=2, block_size=64, seed=0) for d in range(2)]
    per_epoch = replicas[0].per_epoch
    first_epoch = [i for d in range(2) for p in range(per_epoch) for i in replicas[d].sample_ids(p)]
    assert len(set(first_epoch)) == len(first_epoch)
    second = [replicas[0].sample_ids(p) for p in range(per_epoch, 2 * per_epoch)]
    assert second != [replicas[0].sample_ids(p) for p in range(per_epoch)]
    assert replicas[0].sample_ids(per_epoch + 1) == RankBatches(samples, 2, 0, 2, block_size=64).sample_ids(per_epoch + 1)


def test_bad_data_specs_name_the_key_and_the_fix(tmp_path):
    with pytest.raises(DataConfigError, match=r"mtraining.data.files: file\(s\) not found: \['/nope.jsonl'\]"):
        check_data_spec({"files": ["/nope.jsonl"]})
    with pytest.raises(DataConfigError, match="exactly one of"):
        check_data_spec({"files": ["a"], "source": "stdlib"})
    with pytest.raises(DataConfigError, match=r"unknown key\(s\) \['path'\]"):
        check_data_spec({"path": "x"})
    with pytest.raises(DataConfigError, match=r"max_documents=0: give a positive integer"):
        check_data_spec({"source": "stdlib", "max_documents": 0})
    with pytest.raises(DataConfigError, match=r"document_chars=1000: .* with \"source\": \"stdlib\" only"):
        check_data_spec({"files": [write_jsonl(tmp_path, TEXTS)], "document_chars": 1000})
    with pytest.raises(DataConfigError, match="set mtraining.data.format"):
        (tmp_path / "docs.txt").write_text("x")
        check_data_spec({"files": [str(tmp_path / "docs.txt")]})
    with pytest.raises(DataConfigError, match="text_field='body' is not a column"):
        load_documents({"files": [write_jsonl(tmp_path, TEXTS)], "text_field": "body"})
    with pytest.raises(DataConfigError, match="fewer than one sample"):
        packed(TEXTS[:1], 10_000)
    with pytest.raises(DataConfigError, match="fewer than one global micro-batch"):
        RankBatches(packed(TEXTS, 512), micro_batch_size=8, block_size=64)


@pytest.mark.parametrize("world", [1, 2])
def test_document_masking_batches_carry_each_documents_start(world):
    # reference from the stream alone: a document starts at t == 0 or right after an EOS input
    texts = ["a" * 90, "bb" * 20, "c" * 7, "d" * 300, "e" * 64, "f" * 130]
    samples = packed(texts, 128)
    layout = StripedLayout(world, 32)
    for rank in range(world):
        batches = RankBatches(samples, 2, sequence_rank=rank, sequence_world=world, block_size=32,
                              document_masking=True)
        masked = 0
        for position in range(batches.per_epoch):
            batch = batches.batch(position)
            ids = batches.sample_ids(position)
            starts = [[t for t in range(128) if t == 0 or int(samples[i][0][t - 1]) == EOS] for i in ids]
            # a batch of single-document samples has nothing to mask: no doc_start, plain positions
            assert ("doc_start" in batch) == any(len(s) > 1 for s in starts)
            masked += "doc_start" in batch
            for row, i in enumerate(ids):
                inputs = samples[i][0]
                expected = torch.tensor([max(s for s in starts[row] if s <= t) for t in range(128)], dtype=torch.int32)
                if "doc_start" in batch:
                    assert torch.equal(batch["doc_start"][row], expected)
                positions = torch.arange(128) - expected.long()
                assert torch.equal(batch["position_ids"][row], layout.shard(positions[None], rank)[0])
                assert torch.equal(batch["input_ids"][row], layout.shard(inputs[None], rank)[0])
        assert 0 < masked


def test_single_document_batches_carry_no_doc_start():
    """Passkey samples are one document each: with document masking on, their batches carry no
    doc_start (nothing to mask) and the plain striped positions, exactly as with it off."""
    from datasets import Dataset
    texts = [("word " * 200)[:n] for n in (150, 90, 700, 40, 900, 300, 520, 61, 800)]
    samples = PackedSequences(tokenize_documents(Dataset.from_list([{"text": t} for t in texts]), ByteTokenizer()),
                              256, passkey_fraction=1.0, tokenizer=ByteTokenizer(), seed=3)
    for rank in range(2):
        on, off = (RankBatches(samples, 2, sequence_rank=rank, sequence_world=2, block_size=32, document_masking=flag)
                   for flag in (True, False))
        for position in range(on.per_epoch):
            masked, plain = on.batch(position), off.batch(position)
            assert "doc_start" not in masked and masked.keys() == plain.keys()
            assert all(torch.equal(masked[key], plain[key]) for key in plain)


def test_a_passkey_sample_is_one_document():
    from datasets import Dataset
    texts = [("word " * 200)[:n] for n in (150, 90, 700, 40, 900, 300, 520, 61, 800)]
    documents = Dataset.from_list([{"text": t} for t in texts])
    samples = PackedSequences(tokenize_documents(documents, ByteTokenizer()), 512, passkey_fraction=0.5,
                              tokenizer=ByteTokenizer(), seed=3)
    kinds = set()
    for i in range(len(samples)):
        carries = b"pass key" in bytes(int(x) for x in samples[i][0] if int(x) < 256)
        cu = samples.cu_seqlens(i).tolist()
        kinds.add(carries)
        if carries:
            assert cu == [0, 512]
        else:
            inputs = samples[i][0]
            assert cu == [t for t in range(512) if t == 0 or int(inputs[t - 1]) == EOS] + [512]
    assert kinds == {True, False}


def test_a_window_seen_again_asks_for_a_new_answer():
    """A task sample's key, values or names are drawn per epoch: over several epochs of a small
    corpus a fixed draw lets a model learn each window's answer by heart instead of retrieving it.
    The answer, read from the end of the text, differs between epochs for every sample; the batches
    of a later epoch carry that epoch's samples."""
    import re
    from datasets import Dataset
    words = stdlib_documents(max_documents=1)[0]["text"][:40_000]
    documents = Dataset.from_list([{"text": words[k:k + 5000]} for k in range(0, 40_000, 5000)])
    tokenizer = ByteTokenizer()
    samples = PackedSequences(tokenize_documents(documents, tokenizer), 1024, 0.25, tokenizer, seed=3,
                              task_fractions={"multikey": 0.25, "multivalue": 0.25, "vartrack": 0.25})

    def answer(inputs, labels) -> str:  # the sample's last question's answer: what follows its " is" / " are"
        text = bytes(int(x) for x in torch.cat([inputs, labels[-1:]]) if int(x) < 256).decode()
        return re.split(r" (?:is|are) ", text[-120:])[-1]

    for i in range(len(samples)):
        first, again = samples.sample(i, 0), samples.sample(i, 1)
        assert torch.equal(samples.sample(i, 1)[0], again[0])  # a resumed run draws the same sample
        assert answer(*first) != answer(*again), f"sample {i} asks for {answer(*first)!r} in both epochs"
    batches = RankBatches(samples, 2, block_size=64, seed=0)
    position = batches.per_epoch + 1
    assert batches.epoch(position) == 1
    ids = batches.sample_ids(position)
    assert torch.equal(batches.batch(position)["input_ids"], torch.stack([samples.sample(i, 1)[0] for i in ids]))
    assert not torch.equal(batches.batch(position)["input_ids"], torch.stack([samples.sample(i, 0)[0] for i in ids]))
