"""Evaluation harness (ds_mtraining.eval) and the baseline attention modes of the training path
(mtraining.attention: sparse | dense | static), against hand computations and dense references."""
import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import REPO, dense_loss, sequence, text_tokens, tiny_model
from ds_mtraining import SparseConfig
from ds_mtraining.data import ByteTokenizer, PackedSequences
from ds_mtraining.distributed import run_on_ranks
from ds_mtraining.eval import (bucket_edges, exact_match, loss_by_position, model_recall, passkey_grid,
                               passkey_prompt, passkey_training_sample)
from ds_mtraining.passkey import ANSWER, INTRO, NEEDLE, QUESTION
from ds_mtraining.reference import dense_mask
from ds_mtraining.rope import apply_rotary, rotary_tables
from ds_mtraining.static import StaticPattern
from ds_mtraining.training import ConfigError
from ds_mtraining.training.run_config import load_run_config

TOKENIZER = ByteTokenizer()


# ----------------------------------------------------------------------------- passkey
@pytest.mark.parametrize("generated, key, expected", [
    ("71432", "71432", True), (" 71432.", "71432", True), ("\n 71432 is it", "71432", True),
    ("714320", "71432", False), ("7143", "71432", False), ("the key 71432", "71432", False),
    ("", "71432", False), (" 71 432", "71432", False),
])
def test_exact_match_hand_cases(generated, key, expected):
    assert exact_match(generated, key) is expected


@pytest.mark.parametrize("length, depth", [(600, 0.0), (600, 0.37), (777, 1.0)])
def test_passkey_prompt_puts_the_key_where_asked(length, depth):
    filler = text_tokens(800).numpy()
    prompt = passkey_prompt(TOKENIZER, filler, length, depth, "90210")
    ids = prompt.input_ids
    needle = NEEDLE.format(key="90210")
    # by hand: ASCII texts are one byte token per character
    n = length - len(INTRO) - len(needle) - len(QUESTION)
    at = round(depth * n)
    assert len(ids) == length and prompt.needle_start == len(INTRO) + at
    assert TOKENIZER.decode(ids[:len(INTRO)]) == INTRO
    assert TOKENIZER.decode(ids[prompt.needle_start:prompt.needle_start + len(needle)]) == needle
    assert TOKENIZER.decode(ids[-len(QUESTION):]) == QUESTION
    # the filler is the real text window, cut at the needle, not a repeated sentence
    text = np.concatenate([ids[len(INTRO):prompt.needle_start], ids[prompt.needle_start + len(needle):-len(QUESTION)]])
    np.testing.assert_array_equal(text, filler[:n])
    assert TOKENIZER.decode(prompt.answer_ids) == " 90210"


def test_passkey_grid_scores_an_oracle_and_a_wrong_decoder():
    """A decoder that reads the needle back from the prompt scores 1 everywhere; one answering a
    fixed wrong key scores 0; every trial's key appears in its prompt's needle."""
    stream = text_tokens(3000).numpy()
    seen = []

    def oracle(ids, max_new_tokens):
        key = re.search(r"The pass key is (\d+)\.", TOKENIZER.decode(ids)).group(1)
        seen.append((len(ids), key))
        return TOKENIZER.encode(ANSWER.format(key=key) + ".")[:max_new_tokens]

    result = passkey_grid(oracle, TOKENIZER, stream, [400, 900], [0.0, 0.5, 1.0], trials=2, digits=6, seed=3)
    assert result["accuracy"] == [[1.0, 1.0]] * 3
    assert [n for n, _ in seen] == [400] * 6 + [900] * 6
    assert [t["key"] for t in result["trials"]] == [key for _, key in seen]
    assert all(len(key) == 6 and key[0] != "0" for _, key in seen) and len({k for _, k in seen}) == 12
    wrong = passkey_grid(lambda ids, n: TOKENIZER.encode(" 123456"), TOKENIZER, stream, [400], [0.5], trials=3,
                         digits=6, seed=3)
    assert wrong["accuracy"] == [[0.0]]


@pytest.mark.parametrize("answers, expected", [
    ([" 11111.", " 22222"], "2 of 2 hidden keys repeated exactly by the greedy answer"),
    ([" 11111.", " 99999"], "1 of 2 hidden keys repeated exactly by the greedy answer; 1 answered another number; "
                            "a model trained with passkey samples"),
    (["eeeeeee", "\n\n"], "0 of 2 hidden keys repeated exactly by the greedy answer; no answer starts with a number "
                           "(the first: 'eeeeeee'): the model has not learned to answer yet, as after a short run; a "
                           "model trained with passkey samples (passkey_fraction in mtraining.data) at these lengths "
                           "retrieves most keys: docs/RESULTS.md#quality")])
def test_passkey_figure_is_said_in_words(answers, expected):
    """Keys 11111 and 22222, answered by hand: all right; one wrong number; letters only (what an
    untrained byte-level model generates)."""
    from ds_mtraining.eval.passkey import describe_retrieval
    trials = [{"key": key, "generated": answer, "correct": exact_match(answer, key)}
              for key, answer in zip(("11111", "22222"), answers)]
    assert describe_retrieval({"trials": trials}).startswith(expected)


def test_eval_command_says_what_the_passkey_figure_means_for_its_model(tmp_path, capsys):
    """``python -m ds_mtraining.eval`` on an untrained tiny model (as a short demo run exports it):
    the passkey line gives the figure and, beside it, how many keys its trials (passkey.json)
    retrieved and what the model answered instead."""
    from ds_mtraining.eval.cli import main
    tiny_model("qwen2", attn="sdpa").save_pretrained(tmp_path / "model")
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": TOKENIZER.decode(text_tokens(1500).numpy())})
                                                 + "\n" for _ in range(2)))
    main([str(tmp_path / "model"), "--tasks", "passkey", "--lengths", "300", "--depths", "0,1", "--trials", "1",
          "--data", str(tmp_path / "text.jsonl"), "--tokenizer", "bytes", "--device", "cpu", "--no_progress",
          "--out", str(tmp_path / "out")])
    trials = json.loads((tmp_path / "out" / "passkey.json").read_text())["trials"]
    assert not any(trial["correct"] or trial["generated"].lstrip()[:1].isdigit() for trial in trials), trials
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("passkey_accuracy:")]
    assert line == (f"passkey_accuracy: 0.0 (0 of 2 hidden keys repeated exactly by the greedy answer; no answer "
                    f"starts with a number (the first: {trials[0]['generated']!r}): the model has not learned to "
                    f"answer yet, as after a short run; a model trained with passkey samples (passkey_fraction in "
                    f"mtraining.data) at these lengths retrieves most keys: docs/RESULTS.md#quality)"), line


def test_passkey_training_sample_asking_several_times():
    tokens = text_tokens(2049).numpy().astype(np.int64)
    sample = passkey_training_sample(tokens, TOKENIZER, np.random.default_rng(5), questions=4)
    text = TOKENIZER.decode(sample)
    needle = re.search(r"\n\nThe pass key is (\d+)\. Remember it\. \1 is the pass key\.\n\n", text)
    asked = QUESTION + ANSWER.format(key=needle.group(1))
    assert len(sample) == 2049 and text.endswith(asked) and text.count(asked) == 4
    assert text.index(asked) > needle.end()  # every question comes after the needle
    # without the intro, needle and questions, what is left is the window's own text, in order
    filler = text[len(INTRO):].replace(needle.group(0), "").replace(asked, "")
    assert TOKENIZER.decode(tokens).startswith(filler)


def test_passkey_training_samples_in_the_packed_data():
    tokens = text_tokens(1025).numpy().astype(np.int64)
    sample = passkey_training_sample(tokens, TOKENIZER, np.random.default_rng(0))
    text = TOKENIZER.decode(sample)
    key = re.search(r"The pass key is (\d+)\. Remember it\. \1 is the pass key\.", text).group(1)
    assert len(sample) == 1025 and text.endswith(QUESTION + " " + key) and text.startswith(INTRO)

    from datasets import Dataset
    from ds_mtraining.data import tokenize_documents
    documents = Dataset.from_list([{"text": TOKENIZER.decode(text_tokens(40000).numpy())}])
    tokenized = tokenize_documents(documents, TOKENIZER)
    plain = PackedSequences(tokenized, 512)
    mixed = PackedSequences(tokenized, 512, passkey_fraction=0.5, tokenizer=TOKENIZER, seed=7)
    carrying = []
    for i in range(len(plain)):
        inputs, labels = mixed[i]
        torch.testing.assert_close(inputs[1:], labels[:-1])  # still one shifted window
        decoded = TOKENIZER.decode(labels.tolist())
        carrying.append(QUESTION in decoded)
        if not carrying[-1]:
            torch.testing.assert_close(labels, plain[i][1])
        torch.testing.assert_close(mixed[i][0], inputs)  # the same sample every time (resume)
    assert 0.25 < np.mean(carrying) < 0.75, carrying


# ----------------------------------------------------------------------------- loss by position
def test_bucket_edges_by_hand():
    assert bucket_edges(64, 4) == [0, 16, 32, 48, 64]
    assert bucket_edges(50, 3) == [0, 17, 33, 50]


def test_loss_by_position_matches_per_token_cross_entropy_by_hand():
    model = tiny_model("qwen2")
    windows = text_tokens(2 * 101).view(2, 101)
    result = loss_by_position(model, windows, buckets=3, chunk_tokens=32)
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1]).logits.double()
    labels = windows[:, 1:]
    # per token: log-sum-exp of the logits minus the label's logit; buckets [0,33) [33,67) [67,100)
    per_token = torch.logsumexp(logits, -1) - logits.gather(-1, labels[..., None])[..., 0]
    expected = []
    for start, end in [(0, 33), (33, 67), (67, 100)]:
        values = [per_token[w, p].item() for w in range(2) for p in range(start, end)]
        expected.append(sum(values) / len(values))
    assert result["edges"] == [0, 33, 67, 100] and result["tokens"] == [66, 68, 66]
    np.testing.assert_allclose(result["mean_loss"], expected, rtol=1e-5)
    assert result["overall"] == pytest.approx(per_token.mean().item(), rel=1e-5)


# ----------------------------------------------------------------------------- recall
def _reference_qk(model, input_ids):
    """Post-RoPE q/k of every layer, independently: the projections' outputs (forward hooks)
    rotated with ds_mtraining.rope in float64."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta") or config.rope_theta
    captured = {}
    handles = [layer.self_attn.q_proj.register_forward_hook(lambda m, i, o, n=n: captured.__setitem__(("q", n), o))
               for n, layer in enumerate(model.model.layers)]
    handles += [layer.self_attn.k_proj.register_forward_hook(lambda m, i, o, n=n: captured.__setitem__(("k", n), o))
                for n, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(input_ids=input_ids)
    for handle in handles:
        handle.remove()
    cos, sin = rotary_tables(torch.arange(input_ids.shape[1]), head_dim, theta)
    rotate = lambda x: apply_rotary(x.double().view(1, x.shape[1], -1, head_dim), cos, sin)
    return [(rotate(captured[("q", n)]), rotate(captured[("k", n)])) for n in range(len(model.model.layers))]


def _dense_recall(q, k, mask):
    """Float64 [H]: mean over rows of the causal softmax mass inside ``mask`` [H, S, S]."""
    s, h, d = q.shape[1], q.shape[2], q.shape[3]
    kk = k.repeat_interleave(h // k.shape[2], dim=2)
    logits = torch.einsum("bqhd,bkhd->bhqk", q, kk)[0] / d ** 0.5
    logits = logits.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    probs = torch.softmax(logits, -1)
    return (probs * mask).sum((-1, -2)) / s


def test_model_recall_matches_dense_float64():
    model = tiny_model("qwen2")
    input_ids, _ = sequence(seq_len=512)
    sparse = SparseConfig(block_size=64, last_q=32, p_vertical=0.5, p_slash=0.5, max_vertical=8,
                          max_slash_diagonals=2, sink_tokens=2)
    result = model_recall(model, input_ids, sparse, dtype=torch.float64, keep_indices=True)
    causal = 512 * 513 / 2
    for (q, k), row, index in zip(_reference_qk(model, input_ids), result["layers"], result["indices"]):
        mask = dense_mask(index)[0]
        np.testing.assert_allclose(row["recall"], _dense_recall(q, k, mask).numpy(), rtol=0, atol=1e-6)
        np.testing.assert_allclose(row["density"], (mask.sum((-1, -2)).double() / causal).numpy(), rtol=0, atol=1e-12)
        assert max(row["density"]) < 0.8  # a genuinely sparse index
        # the static baseline at the layer's mean density: sinks + local blocks, by its definition
        blocks = StaticPattern(density=float(np.mean(row["density"])), sink_tokens=2).local_blocks(512, 64)
        pos = torch.arange(512)
        static = (pos[None] <= pos[:, None]) & ((pos[None] < 2) | (pos[:, None] // 64 - pos[None] // 64 < blocks))
        np.testing.assert_allclose(row["static_recall"], _dense_recall(q, k, static.expand(4, -1, -1)).numpy(),
                                   rtol=0, atol=1e-6)
        assert row["static_density"] == pytest.approx([static.sum().item() / causal] * 4, abs=1e-12)
    assert model.config._attn_implementation == "eager"  # restored after capturing


def test_index_densities_are_the_dense_masks_share_of_causal_entries():
    # per config: the mean over layers and heads of the estimated index's dense mask / causal entries
    from ds_mtraining.eval.model_recall import index_densities
    model = tiny_model("qwen2")
    input_ids, _ = sequence(seq_len=512)
    configs = [SparseConfig(block_size=64, last_q=32, p_vertical=0.5, p_slash=p, max_vertical=8,
                            max_slash_diagonals=cap, sink_tokens=2) for p, cap in ((0.5, 2), (0.9, 64))]
    causal = 512 * 513 / 2
    expected = []
    for config in configs:
        indices = model_recall(model, input_ids, config, dtype=torch.float64, keep_indices=True)["indices"]
        expected.append(np.mean([dense_mask(index)[0].sum((-1, -2)).double().mean().item() / causal
                                 for index in indices]))
    got = index_densities(model, input_ids, configs)
    np.testing.assert_allclose(got, expected, rtol=1e-9)
    assert got[0] < got[1]  # the larger budget computes more
    assert model.config._attn_implementation == "eager"


# ----------------------------------------------------------------------------- static pattern
@pytest.mark.parametrize("target", [0.05, 0.2, 0.33, 0.9])
def test_static_density_is_the_nearest_achievable(target):
    seq, block, sinks = 1024, 64, 4
    pos = torch.arange(seq)
    causal = pos[None] <= pos[:, None]

    def hand_density(n):  # sinks + n local blocks, counted on the dense mask
        mask = causal & ((pos[None] < sinks) | (pos[:, None] // block - pos[None] // block < n))
        return mask.sum().item() / (seq * (seq + 1) / 2)

    pattern = StaticPattern(density=target, sink_tokens=sinks)
    n = pattern.local_blocks(seq, block)
    candidates = [abs(hand_density(m) - target) for m in range(1, seq // block + 1)]
    assert n == 1 + int(np.argmin(candidates))
    assert pattern.density_at(seq, block) == pytest.approx(hand_density(n), abs=1e-12)
    index = pattern.index(2, 3, seq, block)
    mask = causal & ((pos[None] < sinks) | (pos[:, None] // block - pos[None] // block < n))
    assert torch.equal(dense_mask(index), mask.expand(2, 3, -1, -1))
    assert StaticPattern(window_tokens=128, sink_tokens=0).local_blocks(seq, block) == 2


# ----------------------------------------------------------------------------- training modes
DEMO = json.loads((REPO / "ds_configs" / "cpu_demo.json").read_text())


def mode_config(**mtraining) -> dict:
    config = json.loads(json.dumps(DEMO))
    config["mtraining"].update(seq_len=512, loss_chunk_tokens=256,
                               data={"source": "stdlib", "document_chars": 1 << 16, "max_documents": 2},
                               sparse={"last_q": 32, "p_vertical": 0.5, "p_slash": 0.5, "max_vertical": 8,
                                       "max_slash_diagonals": 2, "sink_tokens": 4})
    config["mtraining"].update(mtraining)
    return config


@pytest.mark.parametrize("change, message", [
    (dict(attention="flash"), r"mtraining.attention='flash' is not an attention mode; use one of "
                              r"\['sparse', 'dense', 'static'\]"),
    (dict(attention="static"), r"mtraining.attention='static' needs mtraining.static"),
    (dict(static={"density": 0.1}), r"mtraining.static is set but mtraining.attention is 'sparse'"),
    (dict(attention="static", static={"density": 0.0}), r"mtraining.static: density=0.0 must be a number in \(0, 1\]"),
    (dict(attention="static", static={"density": 0.1, "window_tokens": 128}), r"give exactly one of 'density'"),
    (dict(attention="static", static={"window_tokens": 100}), r"window_tokens=100 is not a multiple of the stripe block 64"),
    (dict(attention="static", static={"density": 0.1, "sinks": 4}), r"unknown key\(s\) \['sinks'\]"),
    (dict(data={"source": "stdlib", "passkey_fraction": 1.5}), r"mtraining.data.passkey_fraction=1.5 must be"),
    (dict(data={"source": "stdlib", "passkey_questions": 0}), r"mtraining.data.passkey_questions=0 must be"),
])
def test_bad_attention_mode_is_one_clear_error(change, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(mode_config(**change), 2)


STATIC_DENSITY, SEED = 0.3, 1234


def _train_modes_worker(rank, world, root):
    """Two steps of the real training entry point per attention mode, on 2 ranks (flat ring)."""
    from ds_mtraining.train import parse_args, train
    results = {}
    for mode, extra in [("sparse", {}), ("dense", {"attention": "dense"}),
                        ("static", {"attention": "static", "static": {"density": STATIC_DENSITY}})]:
        path = Path(root) / f"{mode}.json"
        if rank == 0:
            path.write_text(json.dumps(mode_config(**extra)))
        torch.distributed.barrier()
        args = parse_args(["--deepspeed_config", str(path), "--steps", "2", "--save_dir", str(Path(root) / mode),
                           "--seed", str(SEED), "--no_progress"])
        results[mode] = train(args)["losses"]
    return results


def _metric(root, mode, name) -> list[float]:
    with (Path(root) / mode / "metrics" / "mtraining" / f"Train_mtraining_{name}.csv").open() as f:
        return [float(row[1]) for row in csv.reader(f) if row and row[0] != "step"]


@pytest.mark.usefixtures("built_ops")  # built before the ranks start
def test_attention_modes_through_the_training_path(tmp_path):
    """Same data, seed and init per mode: dense mode's first loss is the dense HF model's loss on
    that batch; static mode's index has the requested density (nearest achievable, within half a
    block diagonal's step); the default sparse mode is MTraining's estimated attention, equal to a
    single-process run of it."""
    from ds_mtraining.data import RankBatches, load_documents, tokenize_documents
    from ds_mtraining.hf import use_mtraining_attention
    from ds_mtraining.layer import MTrainingAttentionSettings
    from ds_mtraining.training.model import MTrainingCausalLM, build_model
    results = run_on_ranks(_train_modes_worker, 2, str(tmp_path), timeout=300)
    assert results[0] == results[1]
    losses = results[0]
    run, _ = load_run_config(mode_config(), 2)
    samples = PackedSequences(tokenize_documents(load_documents(run.data), TOKENIZER), run.seq_len)
    batch = RankBatches(samples, 1, block_size=64, seed=SEED).batch(0)  # the whole first sequence

    def fresh_model():
        torch.manual_seed(SEED)
        return build_model(run.model)

    dense = dense_loss(fresh_model(), batch["input_ids"], batch["labels"]).item()
    assert losses["dense"][0] == pytest.approx(dense, rel=1e-5)
    assert _metric(tmp_path, "dense", "density") == [1.0, 1.0]

    achieved = StaticPattern(density=STATIC_DENSITY).density_at(512, 64)
    step = 2 * 64 / 512  # density added by one more block diagonal, at most
    assert abs(achieved - STATIC_DENSITY) <= step / 2
    assert _metric(tmp_path, "static", "density") == pytest.approx([achieved] * 2, abs=1e-12)
    assert losses["static"][0] > dense + 1e-3  # the window loses context

    model = fresh_model()
    use_mtraining_attention(model, MTrainingAttentionSettings(run.sparse))
    single = MTrainingCausalLM(model, None, run.loss_chunk_tokens)(**batch).item()
    assert losses["sparse"][0] == pytest.approx(single, rel=1e-5)
    assert max(_metric(tmp_path, "sparse", "density")) < 0.9
    assert all(np.isfinite(v) for mode in losses.values() for v in mode)


def test_corpus_splits_whole_documents_and_reads_gzipped_docs(tmp_path):
    # the reference: every file's text, read independently, lands in exactly one split, whole
    import gzip

    import datasets
    from ds_mtraining.eval.corpus import build_corpus
    docs = tmp_path / "docs"
    texts = {}  # written file (relative) -> its text
    for i in range(12):
        path = docs / f"area{i % 3}" / (f"page{i}.rst.gz" if i % 2 else f"page{i}.rst")
        path.parent.mkdir(parents=True, exist_ok=True)
        text = f"Page {i}\n" + "word " * (50 + 10 * i)
        path.write_bytes(gzip.compress(text.encode()) if i % 2 else text.encode())
        texts[path.relative_to(docs)] = text
    (docs / "translations").mkdir()
    (docs / "translations" / "skip.rst").write_text("not this")
    summary = build_corpus(tmp_path / "out", stdlib=False, docs=[docs], exclude=["translations"],
                           document_chars=400, heldout=0.3, seed=1)
    splits = {name: datasets.Dataset.from_parquet(str(tmp_path / "out" / f"{name}.parquet"))["text"]
              for name in ("train", "heldout")}
    assert summary["train"]["documents"] == len(splits["train"]) >= 1 and len(splits["heldout"]) >= 1
    for relative, text in texts.items():
        where = [name for name, documents in splits.items() for d in documents if f"# {relative}\n{text}" in d]
        assert len(where) == 1, (relative, where)
    assert not any("not this" in d for documents in splits.values() for d in documents)


def test_corpus_code_folders_give_their_py_files_only(tmp_path, capsys):
    # the reference: each .py file's text, read independently, lands in one document; other files in none
    import datasets
    from ds_mtraining.eval.corpus import build_corpus, main
    package = tmp_path / "package"
    texts = {}
    for i in range(6):
        path = package / f"sub{i % 2}" / f"module{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        texts[path.relative_to(package)] = f"def f{i}():\n    return {i}\n" * (20 + i)
        path.write_text(texts[path.relative_to(package)])
    (package / "README.md").write_text("not code")
    summary = build_corpus(tmp_path / "out", stdlib=False, docs=[], code=[package], document_chars=300, heldout=0.3)
    documents = [d for name in ("train", "heldout")
                 for d in datasets.Dataset.from_parquet(str(tmp_path / "out" / f"{name}.parquet"))["text"]]
    assert summary["sources"] == ["package"]
    for relative, text in texts.items():
        assert sum(f"# {relative}\n{text}" in d for d in documents) == 1, relative
    assert not any("not code" in d for d in documents)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "none"), "--code", str(tmp_path / "empty")])
    assert f"--code {tmp_path / 'empty'}: no .py files" in capsys.readouterr().err
