"""The training engine's pieces: config validation (every bad input one clear error before
training), process groups / mpu under a real DeepSpeed ZeRO-2 engine, and the Ulysses drop-in
``DistributedAttention`` in both call forms against float64 dense causal attention."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ds_mtraining import SparseConfig
from ds_mtraining.distributed import initialize_groups, run_on_ranks
from ds_mtraining.layer import DistributedAttention, LayoutError
from ds_mtraining.reference import dense_attention
from ds_mtraining.ring.layout import StripedLayout
from ds_mtraining.train import ConfigError, load_run_config, parse_run_config

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "ds_configs" / "cpu_demo.json"
TIMEOUT_S = 240


def demo_config(**mtraining) -> dict:
    config = json.loads(DEMO_CONFIG.read_text())
    config["mtraining"].update(mtraining)
    return config


# ----------------------------------------------------------------------------- config errors
@pytest.mark.parametrize("change, world, message", [
    (dict(seq_len=1000), 2,
     r"mtraining.seq_len=1000 is not divisible by stripe_block x sequence_parallel_size = 64 x 2 = 128; "
     r"use a multiple of 128 \(e.g. 896 or 1024\)"),
    (dict(sequence_parallel_size=3), 4,
     r"mtraining.sequence_parallel_size=3 does not divide the world size 4 .*use one of \[1, 2, 4\]"),
    (dict(ring="spiral"), 2, r"mtraining.ring='spiral' is not a ring kind; use one of \['flat', 'hierarchical', 'auto'\]"),
    (dict(sparse={"p_vertical": 1.5}), 2, r"mtraining.sparse: SparseConfig.p_vertical=1.5 is out of range; top-p must be in \(0, 1\]"),
    (dict(sparse={"p_slash": 0.0}), 2, r"mtraining.sparse: SparseConfig.p_slash=0.0 is out of range"),
    (dict(sparse={"top_p": 0.9}), 2, r"unknown key\(s\) \['top_p'\] in 'mtraining.sparse'"),
    (dict(stripe_block=96), 2, r"mtraining.sparse: SparseConfig.block_size=96 is unsupported; use one of \(64, 128\)"),
    (dict(stripe_block=128, sparse={"block_size": 64}), 2, r"stripe_block=128 differs from mtraining.sparse.block_size=64"),
    (dict(data={"files": ["/no/such/corpus.jsonl"]}), 2,
     r"mtraining.data.files: file\(s\) not found: \['/no/such/corpus.jsonl'\]; give existing local"),
    (dict(model={"name_or_path": "tiny-qwen2", "config_overrides": {"num_key_value_heads": 3}}), 2,
     r"mtraining.model \(tiny-qwen2\): num_attention_heads=4 is not divisible by num_key_value_heads=3 .*"
     r"choose num_key_value_heads among \[1, 2, 4\]"),
    (dict(model="Qwen/Qwen2.5-3B"), 2, r"mtraining.model='Qwen/Qwen2.5-3B' is neither a preset .* never downloaded"),
    (dict(model={"name_or_path": "tiny-qwen2", "config_overrides": {"vocab_size": 100}}), 2,
     r"mtraining.tokenizer has 257 tokens but the model's vocab_size is 100"),
    (dict(loss_chunk_tokens=0), 2, r"mtraining.loss_chunk_tokens=0 must be a positive integer"),
    (dict(seq_lenght=1024), 2, r"unknown key\(s\) \['seq_lenght'\] in 'mtraining'"),
])
def test_bad_config_is_one_clear_error(change, world, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(demo_config(**change), world)


def test_config_without_section_and_a_valid_one():
    config = demo_config()
    run, rest = load_run_config(config, 2)
    assert "mtraining" not in rest and rest["zero_optimization"]["stage"] == 2
    assert (run.seq_len, run.sequence_parallel_size, run.sparse.block_size) == (1024, 2, 64)
    del config["mtraining"]
    with pytest.raises(ConfigError, match="no \"mtraining\" section"):
        load_run_config(config, 2)


@pytest.mark.parametrize("name", ["cpu_demo.json", "zero2_offload_bf16.json", "qwen2.5-3b_512k.json"])
def test_shipped_configs_are_valid(name, tmp_path):
    """Every shipped JSON's mtraining section validates for a world of its sequence-parallel size
    (the GPU configs' model/data paths are placeholders, given with --model/--data)."""
    section = json.loads((REPO / "ds_configs" / name).read_text())["mtraining"]
    if section["model"] not in ("tiny-qwen2",):
        section["model"] = str(tmp_path)  # a local model directory
    run = parse_run_config(section, world_size=section["sequence_parallel_size"])
    assert run.seq_len % (run.sparse.block_size * run.sequence_parallel_size) == 0
    if name.startswith("qwen2.5-3b"):  # the paper's setting: 512K tokens over 32 GPUs, 16K per GPU
        assert (run.seq_len, run.sequence_parallel_size, run.sparse.p_vertical, run.sparse.max_slash) == \
            (524288, 32, 0.9, 4096)


def test_cli_reports_config_errors_before_any_process_group(tmp_path):
    """The entry point exits with the message at once: no init_distributed (which would wait for
    a second rank that never comes), no model, no data."""
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(demo_config(seq_len=1000)))
    env = dict(os.environ, WORLD_SIZE="2", RANK="0", PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "ds_mtraining.train", "--deepspeed_config", str(path)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "configuration error: mtraining.seq_len=1000 is not divisible" in result.stderr


# ----------------------------------------------------------------------------- groups + DeepSpeed
SEQ, BLOCK = 256, 64


def _engine_worker(rank, world):
    """4 ranks = 2 data-parallel replicas x 2 sequence-parallel ranks, one ZeRO-2 SGD step."""
    import deepspeed
    from deepspeed.utils import groups as ds_groups
    from test_hf import sequence, tiny_model
    from ds_mtraining.hf import use_mtraining_attention
    from ds_mtraining.layer import MTrainingAttentionSettings
    from ds_mtraining.train import MTrainingCausalLM

    deepspeed.init_distributed()
    groups = initialize_groups(2, "flat")
    probe = torch.tensor([float(rank)])
    dist.all_reduce(probe, group=groups.sequence_group)
    model = tiny_model("qwen2")
    full = SparseConfig(block_size=BLOCK, p_vertical=1.0, p_slash=1.0, max_vertical=SEQ * 2, max_slash=SEQ * 2)
    use_mtraining_attention(model, MTrainingAttentionSettings.from_groups(full, groups))
    module = MTrainingCausalLM(model, groups.sequence_group, loss_chunk_tokens=64)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10 ** 6}
    engine, *_ = deepspeed.initialize(model=module, config=config, mpu=groups,
                                      optimizer=torch.optim.SGD(module.parameters(), lr=0.5))
    input_ids, labels = sequence(batch=2)
    data_rank, sequence_rank = groups.get_data_parallel_rank(), groups.get_sequence_parallel_rank()
    layout = StripedLayout(2, BLOCK)
    rows = slice(data_rank, data_rank + 1)
    pick = lambda x: layout.shard(x[rows], sequence_rank)
    loss = engine(pick(input_ids), pick(labels), layout.positions(input_ids.shape[1], sequence_rank)[None])
    engine.backward(loss)
    engine.step()
    return {"sequence_ranks": groups.sequence_ranks, "data_ranks": groups.data_ranks, "probe": probe.item(),
            "ds_sizes": (ds_groups._get_data_parallel_world_size(), ds_groups._get_sequence_parallel_world_size(),
                         ds_groups._get_sequence_data_parallel_world_size()),
            "loss": loss.item(), "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.slow
def test_mpu_groups_drive_a_zero2_engine_like_one_process():
    """ZeRO-2 with the mpu sums gradients over the sequence-parallel ranks and averages over the
    data-parallel replicas: after one SGD step (gradient norm clipped to 1, DeepSpeed's default,
    so the partitioned norm is checked too) every rank's parameters equal a single process's dense
    step on the mean loss of both sequences."""
    from test_hf import dense_loss, sequence, tiny_model
    results = run_on_ranks(_engine_worker, 4, timeout=TIMEOUT_S)
    assert [r["sequence_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["data_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["probe"] for r in results] == [1.0, 1.0, 5.0, 5.0]  # sums inside each ring only
    assert all(r["ds_sizes"] == (2, 2, 4) for r in results)
    model = tiny_model("qwen2")
    input_ids, labels = sequence(batch=2)
    losses = [dense_loss(model, input_ids[i:i + 1], labels[i:i + 1]) for i in range(2)]
    (sum(losses) / 2).backward()
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) > 1.5  # clipping is active
    for rank, result in enumerate(results):
        assert result["loss"] == pytest.approx(losses[rank // 2].item(), rel=1e-5)
        for name, param in model.named_parameters():
            torch.testing.assert_close(result["params"][name], param.detach() - 0.5 * param.grad,
                                       rtol=1e-5, atol=1e-6, msg=name)


# ----------------------------------------------------------------------------- Ulysses drop-in
HEADS, KV_HEADS, DIM = 4, 2, 16
FULL = SparseConfig(block_size=BLOCK, p_vertical=1.0, p_slash=1.0, max_vertical=SEQ, max_slash=SEQ)


def rope_tables(seq_len: int):
    """Rotate-half RoPE cos/sin [1, S, 1, D] (theta 1e4), the DeepSpeed rotary_pos_emb shape."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, DIM, 2).double() / DIM)
    angles = torch.arange(seq_len).double()[:, None] * inv_freq[None]
    angles = torch.cat([angles, angles], -1)
    return angles.cos()[None, :, None].float(), angles.sin()[None, :, None].float()


def rope_reference(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def qkv():
    generator = torch.Generator().manual_seed(7)
    shapes = [(1, SEQ, HEADS, DIM), (1, SEQ, KV_HEADS, DIM), (1, SEQ, KV_HEADS, DIM)]
    return [torch.randn(s, generator=generator) for s in shapes]


class LocalAttention(torch.nn.Module):
    """Stands in for the model's own attention; the drop-in reads its scale."""
    softmax_scale = 0.3


def _drop_in_worker(rank, world):
    layout = StripedLayout(world, BLOCK)
    attention = DistributedAttention(LocalAttention(), dist.group.WORLD, sparse_config=FULL)
    positions = layout.positions(SEQ, rank)
    cos, sin = rope_tables(SEQ)
    q, k, v = qkv()
    grad_out = torch.randn(1, SEQ, HEADS, DIM, generator=torch.Generator().manual_seed(8))
    results = {}
    # Megatron-DeepSpeed flash form: [B, S/W, H, D], batch_dim_idx=0, RoPE tables of the global length
    shards = [layout.shard(t, rank).requires_grad_() for t in (q, k, v)]
    out = attention(*shards, 0, rotary_pos_emb=(cos, sin), position_ids=positions[None])
    (out * layout.shard(grad_out, rank)).sum().backward()
    results["bshd"] = (out.detach(), *[s.grad for s in shards])
    # Megatron core-attention form: [S/W, B, H, D] with the causal attention mask (True = masked)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
    shards = [layout.shard(t, rank).transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v)]
    out = attention(*shards, mask, position_ids=positions)
    results["sbhd"] = out.detach().transpose(0, 1)
    errors = {}
    local = SEQ // world
    contiguous = torch.arange(rank * local, (rank + 1) * local)
    for name, call in {
        "contiguous": lambda: attention(*shards, 1, position_ids=contiguous),
        "not_causal": lambda: attention(*shards, ~mask, position_ids=positions),
        "causal_false": lambda: attention(*shards, 1, causal=False),
    }.items():
        try:
            call()
            errors[name] = None
        except (LayoutError, ValueError) as error:
            errors[name] = str(error)
    results["errors"] = errors
    return results


def test_drop_in_distributed_attention_both_call_forms_equal_dense():
    world = 2
    results = run_on_ranks(_drop_in_worker, world, timeout=TIMEOUT_S)
    layout = StripedLayout(world, BLOCK)
    q, k, v = qkv()
    cos, sin = rope_tables(SEQ)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()[None, None].expand(1, HEADS, SEQ, SEQ)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    grad_out = torch.randn(1, SEQ, HEADS, DIM, generator=torch.Generator().manual_seed(8))
    roped = dense_attention(rope_reference(q64, cos, sin), rope_reference(k64, cos, sin), v64, causal, 0.3)
    roped.backward(grad_out.double())
    plain = dense_attention(q, k, v, causal, 0.3)
    tol = dict(rtol=1e-4, atol=1e-5)
    for i, expected in enumerate((roped.detach(), q64.grad, k64.grad, v64.grad)):
        got = layout.unshard([r["bshd"][i] for r in results])
        torch.testing.assert_close(got.double(), expected, **tol)
    torch.testing.assert_close(layout.unshard([r["sbhd"] for r in results]).double(), plain, **tol)
    for rank, result in enumerate(results):
        errors = result["errors"]
        assert "contiguous shard" in errors["contiguous"] and "StripedLayout(2, 64)" in errors["contiguous"]
        assert "not the causal mask" in errors["not_causal"]
        assert "causal only" in errors["causal_false"]


def test_drop_in_constructor_checks():
    with pytest.raises(ValueError, match="pass scatter_idx=2"):
        DistributedAttention(LocalAttention(), None, scatter_idx=1)

    class NonCausal(torch.nn.Module):
        causal = False
    with pytest.raises(ValueError, match="causal is False"):
        DistributedAttention(NonCausal(), None)
