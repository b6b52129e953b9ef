"""MTraining in the user's own code (ds_mtraining.integration, examples/): the DeepSpeed-loop and HF
Trainer examples against ds_mtraining.train and against the dense single-process model, ranks
holding different numbers of valid tokens, the adapter's one-line errors, the twins' diff.

One launch of 2 gloo ranks runs every multi-process case (train, the two examples with the sparse
index and with a full one, the uneven-labels loss, the lengths error, the destroy hook)."""
import difflib
import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers import dense_loss, every_entry_config, sequence, summed_grads, tiny_model
from ds_mtraining.distributed import run_on_ranks
from ds_mtraining.integration import SequenceParallelLoader, resolve_settings, shard_sequences, whole_sequences
from ds_mtraining.layout import StripedLayout

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
TIMEOUT_S = 300
SEQ, SEED, SAMPLES, BLOCK = 512, 1234, 4, 64
TWINS = [("deepspeed_loop.py", "deepspeed_loop_mtraining.py"), ("trainer.py", "trainer_mtraining.py")]


def train_config(sparse: dict | None = None) -> dict:
    """The CPU demo's JSON (ZeRO-2 + CPU offload) on random tokens, plain SGD with lr 1 and no
    clipping or schedule (a parameter moves by minus its gradient), for ds_mtraining.train and
    the DeepSpeed-loop example alike."""
    config = json.loads((REPO / "ds_configs" / "cpu_demo.json").read_text())
    config["mtraining"].update(seq_len=SEQ, loss_chunk_tokens=128, data={"source": "random", "samples": SAMPLES})
    if sparse is not None:
        config["mtraining"]["sparse"] = sparse
    config.update(optimizer={"type": "SGD", "params": {"lr": 1.0}}, gradient_clipping=0.0,
                  zero_allow_untested_optimizer=True)
    del config["scheduler"]
    return config


def trainer_config(sparse: dict | None = None) -> dict:
    """The same for the HF Trainer: its values 'auto' (the Trainer's arguments give SGD, lr 1,
    no clipping), the optimizer the Trainer's own."""
    config = train_config(sparse)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        config[key] = "auto"
    del config["optimizer"]
    return config


def samples_in_train_order() -> list:
    """ds_mtraining.train's first micro-batches (one data-parallel replica) as a dataset of whole
    sequences with labels already shifted (``shift_labels``), in the order train reads them."""
    from ds_mtraining.data import RandomSequences, RankBatches
    samples = RandomSequences(SEQ, 257, SAMPLES, SEED)
    order = [i for p in range(SAMPLES) for i in RankBatches(samples, 1, block_size=BLOCK, seed=SEED).sample_ids(p)]
    return [{"input_ids": samples[i][0], "shift_labels": samples[i][1]} for i in order]


def _example(name: str, root: Path, config: dict, steps: int, tag: str) -> dict:
    path = root / f"{tag}.json"
    if dist.get_rank() == 0:
        path.write_text(json.dumps(config))
    dist.barrier()
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    result = importlib.import_module(name).main(
        ["--deepspeed_config", str(path), "--model", "tiny-qwen2", "--seq_len", str(SEQ), "--steps", str(steps), "--seed", str(SEED),
         "--learning_rate", "1.0", "--max_grad_norm", "0.0", "--output_dir", str(root / f"out_{tag}")],
        dataset=samples_in_train_order())
    return {"losses": result["losses"], "params": {n: p.detach().clone() for n, p in result["model"].named_parameters()}}


def _uneven_labels(rank: int) -> dict:
    """Labels valid on rank 0's stripes (and a few of rank 1's) only: the loss and the summed
    gradients of the group, full index, no DeepSpeed."""
    from ds_mtraining.integration import enable
    model = tiny_model("qwen2", seed=3)
    mt = enable(model, sparse=every_entry_config(SEQ, BLOCK), loss_chunk_tokens=100)
    ids, labels = sequence()
    owner = (torch.arange(SEQ) // BLOCK) % 2
    labels = torch.where((owner == 0) | (torch.arange(SEQ) % 97 == 0), labels, -100)
    batch = next(iter(mt.loader([{"input_ids": ids, "shift_labels": labels}], sharding="sequence")))
    loss = model(**batch).loss
    loss.backward()
    valid = int((batch["shift_labels"] != -100).sum())
    return {"loss": loss.item(), "grads": summed_grads(model, mt.groups.sequence_group), "valid": valid,
            "num_valid_tokens": int(batch["num_valid_tokens"])}


def _lengths_error(mt_groups) -> str | None:
    length = SEQ if dist.get_rank() == 0 else SEQ - 128
    loader = SequenceParallelLoader([{"input_ids": torch.zeros(1, length, dtype=torch.long)}], mt_groups, BLOCK)
    try:
        next(iter(loader))
    except ValueError as error:
        return str(error)
    return None


def _worker(rank, world, root):
    from ds_mtraining.estimator import graphs as estimate_graph
    from test_training import _train_in_process
    root = Path(root)
    full = every_entry_config(SEQ, BLOCK).to_dict()
    results = {"train": _train_in_process(rank, root, "train", train_config(), 2, SEED)}
    results["train"] = {"losses": results["train"]["losses"],
                        "params": {n: p.detach().clone() for n, p in results["train"]["model"].named_parameters()}}
    results["loop"] = _example("deepspeed_loop_mtraining", root, train_config(), 2, "loop")
    results["trainer"] = _example("trainer_mtraining", root, trainer_config(), 2, "trainer")
    results["loop_full"] = _example("deepspeed_loop_mtraining", root, train_config(full), 1, "loop_full")
    results["trainer_full"] = _example("trainer_mtraining", root, trainer_config(full), 1, "trainer_full")
    results["uneven"] = _uneven_labels(rank)
    from ds_mtraining.distributed import initialize_groups
    results["lengths_error"] = _lengths_error(initialize_groups(2))
    calls, release = [], estimate_graph.release
    estimate_graph.release = lambda: calls.append(1) or release()
    try:
        dist.destroy_process_group(dist.new_group([0, 1]))  # the user's own call: graphs released first
    finally:
        estimate_graph.release = release
    results["releases_before_destroy"] = len(calls)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory, built_ops):
    return run_on_ranks(_worker, 2, str(tmp_path_factory.mktemp("integration")), timeout=TIMEOUT_S)


def dense_reference(sample_index: int = 0):
    """The dense single-process model's loss and gradients on train's first sequence."""
    from ds_mtraining.training.model import build_model
    torch.manual_seed(SEED)
    model = build_model({"name_or_path": "tiny-qwen2", "config_overrides": {}})
    sample = samples_in_train_order()[sample_index]
    loss = dense_loss(model, sample["input_ids"][None], sample["shift_labels"][None])
    loss.backward()
    return model, loss


@pytest.mark.parametrize("example", ["loop", "trainer"])
def test_examples_train_like_ds_mtraining_train(results, example):
    """The MTraining DeepSpeed loop and Trainer scripts (2 ranks, the sparse index, ZeRO-2, SGD lr 1)
    give ds_mtraining.train's first two losses (rel 1e-6) and its parameters after two steps, i.e.
    the same gradients (atol 1e-6: the same kernels and loss in the same order; the Trainer's
    optimizer is its own torch SGD, train's DeepSpeed's)."""
    for rank in range(2):
        ours, train = results[rank][example], results[rank]["train"]
        assert len(ours["losses"]) == 2
        assert ours["losses"] == pytest.approx(train["losses"], rel=1e-6), rank
        for name, value in train["params"].items():
            torch.testing.assert_close(ours["params"][name], value, rtol=1e-5, atol=1e-6, msg=f"{example} {name}")


@pytest.mark.parametrize("example", ["loop_full", "trainer_full"])
def test_examples_with_a_full_index_equal_the_dense_model(results, example):
    """With a full index (p = 1, caps >= S) each example's first loss equals the dense
    single-process HF model's on the whole sequence (rel 1e-5) and its one SGD step (lr 1) moves
    every parameter by minus the dense gradient (rtol 1e-4, atol 2e-6: sums in another order)."""
    model, loss = dense_reference()
    for rank in range(2):
        ours = results[rank][example]
        assert ours["losses"][0] == pytest.approx(loss.item(), rel=1e-5), rank
        for name, param in model.named_parameters():
            moved = param.detach() - ours["params"][name]
            torch.testing.assert_close(moved, param.grad, rtol=1e-4, atol=2e-6, msg=f"{example} {name}")


def test_ranks_with_different_valid_token_counts_give_the_global_loss(results):
    """Labels valid on rank 0's stripes and only every 97th token of rank 1's: the loss equals the
    single-process mean over every valid token (rel 1e-5) and the group's summed gradients its
    gradients (rtol 1e-4, atol 2e-6)."""
    model = tiny_model("qwen2", seed=3)
    ids, labels = sequence()
    owner = (torch.arange(SEQ) // BLOCK) % 2
    labels = torch.where((owner == 0) | (torch.arange(SEQ) % 97 == 0), labels, -100)
    loss = dense_loss(model, ids, labels)  # cross_entropy's mean over the labels != -100
    loss.backward()
    counts = [results[rank]["uneven"]["valid"] for rank in range(2)]
    assert counts[0] > 10 * counts[1] > 0 and sum(counts) == int((labels != -100).sum())
    for rank in range(2):
        uneven = results[rank]["uneven"]
        assert uneven["num_valid_tokens"] == sum(counts)
        assert uneven["loss"] == pytest.approx(loss.item(), rel=1e-5)
        for name, param in model.named_parameters():
            torch.testing.assert_close(uneven["grads"][name], param.grad, rtol=1e-4, atol=2e-6, msg=name)


def test_different_lengths_per_rank_is_one_line_on_every_rank(results):
    for rank in range(2):
        message = results[rank]["lengths_error"]
        assert message == ("the sequence-parallel group's ranks hold batches of different shapes [B, S] "
                           "[(1, 512), (1, 384)] (rank order); every rank needs the same B and S: collate to one "
                           "fixed length (pack, or cut)")


def test_destroy_process_group_releases_the_estimator_graphs_first(results):
    assert all(results[rank]["releases_before_destroy"] == 1 for rank in range(2))


# ----------------------------------------------------------------------------- single process
def test_adapter_shifts_on_the_whole_sequence_then_stripes():
    """HF-style labels (not shifted) are shifted on the whole sequence (the last token has no
    label), then striped with the global positions; packed documents (position_ids restarting at
    0, HF's DataCollatorWithFlattening) give doc_start and per-document positions."""
    layout = StripedLayout(2, BLOCK)
    ids = torch.arange(SEQ)[None] + 1000
    positions = torch.cat([torch.arange(200), torch.arange(SEQ - 200)])[None]
    whole = whole_sequences({"input_ids": ids, "labels": ids, "position_ids": positions,
                             "attention_mask": torch.ones_like(ids)})
    for rank in range(2):
        shard = shard_sequences(whole, layout, rank)
        places = layout.positions(SEQ, rank)
        assert torch.equal(shard["input_ids"][0], ids[0, places])
        expected = torch.where(places < SEQ - 1, places + 1001, -100)
        assert torch.equal(shard["shift_labels"][0], expected)
        assert torch.equal(shard["position_ids"][0], positions[0, places])
        assert shard["doc_start"][0, 250].item() == 200 and int(shard["num_valid_tokens"]) == SEQ - 1
    plain = shard_sequences(whole_sequences({"input_ids": ids}), layout, 1)
    assert "doc_start" not in plain and torch.equal(plain["position_ids"][0], layout.positions(SEQ, 1))
    loader = SequenceParallelLoader([{"input_ids": ids[0], "cu_seqlens": torch.tensor([0, 200, SEQ])}], None, BLOCK)
    assert len(loader) == 1 and next(iter(loader))["doc_start"][0, 250].item() == 200


@pytest.mark.parametrize("batch, message", [
    ({"input_ids": torch.zeros(1, 1000, dtype=torch.long)},
     r"^sequence length=1000 is not divisible by sequence-parallel ranks x block = 2 x 64 = 128; pad or cut the "
     r"sequence to a multiple of 128 \(e.g. 896 or 1024\); pad tokens at the end need labels -100 and no "
     r"attention_mask$"),
    ({"input_ids": torch.zeros(2, SEQ, dtype=torch.long),
      "attention_mask": torch.cat([torch.ones(2, SEQ - 10), torch.zeros(2, 10)], 1).long()},
     r"^attention_mask masks 20 of the batch's 2 x 512 tokens \(padding\): MTraining attention takes no mask; pack "
     r"sequences back to back to a fixed length instead .*or give pad tokens at the end labels -100 and no "
     r"attention_mask$"),
    ({"input_ids": torch.zeros(1, SEQ, dtype=torch.long), "labels": torch.zeros(1, SEQ - 1, dtype=torch.long)},
     r"^batch\['labels'\] has shape \(1, 511\), input_ids \(1, 512\); give one entry per token$"),
    ({"input_ids": torch.zeros(1, SEQ, dtype=torch.long), "position_ids": torch.arange(SEQ)[None] + 5},
     r"^batch\['position_ids'\] are neither 0..S-1 nor restarting at 0 in each packed document"),
    ({"input_ids": torch.zeros(1, SEQ, dtype=torch.long), "pixel_values": torch.zeros(1)},
     r"^batch key\(s\) \['pixel_values'\] are not handled by MTraining's adapter"),
])
def test_bad_input_is_one_clear_line(batch, message):
    with pytest.raises(ValueError, match=message) as error:
        shard_sequences(whole_sequences(batch), StripedLayout(2, BLOCK), 0)
    assert "\n" not in str(error.value)


def test_settings_come_from_the_train_json_and_keywords_override():
    settings = resolve_settings(REPO / "ds_configs" / "cpu_demo.json", 4, loss_chunk_tokens=64)
    assert (settings.sequence_parallel_size, settings.sparse.block_size, settings.loss_chunk_tokens) == (2, 64, 64)
    assert resolve_settings(None, 2).sequence_parallel_size == 2
    # every key ds_mtraining.train reads is welcome (the memory tools belong to its loop), one JSON for both
    e2e = json.loads((REPO / "ds_configs" / "e2e_zero2_offload_bf16.json").read_text())
    e2e["mtraining"].update(sequence_parallel_size=1, memory={"tiled_mlp": False, "offload_checkpoints": "none"})
    assert resolve_settings(e2e, 1).loss_chunk_tokens == 4096
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['memroy'\] in 'mtraining'"):
        resolve_settings({"mtraining": {"memroy": {}}}, 1)
    with pytest.raises(ValueError, match=r"sequence_parallel_size=3 does not divide the world size 4"):
        resolve_settings(None, 4, sequence_parallel_size=3)


@pytest.mark.parametrize("plain, mtraining", TWINS)
def test_each_mtraining_example_differs_from_its_plain_twin_by_at_most_ten_lines(plain, mtraining):
    a, b = ((EXAMPLES / name).read_text().splitlines() for name in (plain, mtraining))
    changed = sum(j2 - j1 for tag, _, _, j1, j2 in difflib.SequenceMatcher(None, a, b).get_opcodes() if tag != "equal")
    assert 0 < changed <= 10, changed
    assert "ds_mtraining.integration" not in "\n".join(a) and "import ds_mtraining.integration" in "\n".join(b)


def test_the_docs_show_the_twins_diffs():
    docs = (REPO / "docs" / "INTEGRATION.md").read_text()
    for plain, mtraining in TWINS:
        a, b = ((EXAMPLES / name).read_text().splitlines() for name in (plain, mtraining))
        diff = "\n".join(difflib.unified_diff(a, b, f"examples/{plain}", f"examples/{mtraining}", lineterm="", n=1))
        assert diff in docs, f"docs/INTEGRATION.md lacks the diff of {plain} -> {mtraining}:\n{diff}"
