"""The training engine's pieces: config validation (every bad input one clear error before
training) and process groups / mpu under a real DeepSpeed ZeRO-2 engine. The Ulysses drop-in
``DistributedAttention`` is tested in test_layer.py."""
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
from ds_mtraining.layout import StripedLayout
from ds_mtraining.training import ConfigError
from ds_mtraining.training.run_config import load_run_config, parse_run_config

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
     r"mtraining.seq_len=1000 is not divisible by sequence_parallel_size x stripe_block = 2 x 64 = 128; "
     r"pad or cut the sequence to a multiple of 128 \(e.g. 896 or 1024\)"),
    (dict(sequence_parallel_size=3), 4,
     r"mtraining.sequence_parallel_size=3 does not divide the world size 4 .*use one of \[1, 2, 4\]"),
    (dict(ring="spiral"), 2, r"mtraining.ring='spiral' is not a ring kind; use one of \['flat', 'hierarchical', 'auto'\]"),
    (dict(sparse={"p_vertical": 1.5}), 2, r"mtraining.sparse: SparseConfig.p_vertical=1.5 is out of range; top-p must be in \(0, 1\]"),
    (dict(sparse={"p_slash": 0.0}), 2, r"mtraining.sparse: SparseConfig.p_slash=0.0 is out of range"),
    (dict(sparse={"top_p": 0.9}), 2, r"unknown key\(s\) \['top_p'\] in 'mtraining.sparse'"),
    (dict(stripe_block=96), 2, r"mtraining.stripe_block=96 is unsupported; use one of \[64, 128\]"),
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
    (dict(keep_attention_output="yes"), 2, r"mtraining.keep_attention_output='yes' must be true or false"),
    (dict(stall_timeout_s=-1), 2, r"mtraining.stall_timeout_s=-1 must be a number of seconds >= 0 \(0: no stall "
                                  r"detection\)"),
    (dict(max_nonfinite_steps=1.5), 2, r"mtraining.max_nonfinite_steps=1.5 must be an integer >= 0"),
    (dict(keep_attention_output=True, gradient_checkpointing=False), 2,
     r"mtraining.keep_attention_output=true keeps each layer's attention output .* checkpointing is off: set "
     r"mtraining.gradient_checkpointing to true, or this to false"),
])
def test_bad_config_is_one_clear_error(change, world, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(demo_config(**change), world)


def test_keep_attention_output_reaches_the_run_config():
    run, _ = load_run_config(demo_config(gradient_checkpointing=True, keep_attention_output=True), 2)
    assert run.keep_attention_output is True
    assert load_run_config(demo_config(), 2)[0].keep_attention_output is False


def test_config_without_section_and_a_valid_one():
    config = demo_config()
    run, rest = load_run_config(config, 2)
    assert "mtraining" not in rest and rest["zero_optimization"]["stage"] == 2
    assert (run.seq_len, run.sequence_parallel_size, run.sparse.block_size) == (1024, 2, 64)
    del config["mtraining"]
    with pytest.raises(ConfigError, match="no \"mtraining\" section"):
        load_run_config(config, 2)


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "ds_configs").glob("*.json")))
def test_shipped_configs_are_valid(name, tmp_path):
    """Every shipped JSON's mtraining section validates for a world of its sequence-parallel size
    (the GPU configs' model/data paths are placeholders, given with --model/--data)."""
    section = json.loads((REPO / "ds_configs" / name).read_text())["mtraining"]
    if section["model"] not in ("tiny-qwen2",):
        section["model"] = str(tmp_path)  # a local model directory
    run = parse_run_config(section, world_size=section["sequence_parallel_size"])
    assert run.seq_len % (run.sparse.block_size * run.sequence_parallel_size) == 0
    if name.startswith("qwen2.5-3b"):  # the paper's setting: 512K tokens over 32 GPUs, 16K per GPU
        assert (run.seq_len, run.sequence_parallel_size, run.sparse.p_vertical, run.sparse.max_slash_diagonals) == \
            (524288, 32, 0.9, 4096)


def test_cli_reports_config_errors_before_any_process_group(tmp_path):
    """The entry point exits with one line at once: no init_distributed (which would wait for a
    second rank that never comes), no model, no data, no traceback."""
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(demo_config(seq_len=1000)))
    env = dict(os.environ, WORLD_SIZE="2", RANK="0", PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "ds_mtraining.train", "--deepspeed_config", str(path)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        "ds_mtraining.train: configuration error: mtraining.seq_len=1000 is not divisible"), result.stderr


# ----------------------------------------------------------------------------- groups + DeepSpeed
SEQ, BLOCK = 256, 64


def _engine_worker(rank, world):
    """4 ranks = 2 data-parallel replicas x 2 sequence-parallel ranks, one ZeRO-2 SGD step."""
    import deepspeed
    from deepspeed.utils import groups as ds_groups
    from helpers import sequence, tiny_model
    from ds_mtraining.hf import use_mtraining_attention
    from ds_mtraining.layer import MTrainingAttentionSettings
    from ds_mtraining.training.model import MTrainingCausalLM

    deepspeed.init_distributed()
    groups = initialize_groups(2, "flat")
    probe = torch.tensor([float(rank)])
    dist.all_reduce(probe, group=groups.sequence_group)
    model = tiny_model("qwen2")
    full = SparseConfig(block_size=BLOCK, p_vertical=1.0, p_slash=1.0, max_vertical=SEQ * 2, max_slash_diagonals=SEQ * 2)
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
@pytest.mark.usefixtures("built_ops")  # built before the ranks start
def test_mpu_groups_drive_a_zero2_engine_like_one_process():
    """ZeRO-2 with the mpu sums gradients over the sequence-parallel ranks and averages over the
    data-parallel replicas: after one SGD step (gradient norm clipped to 1, DeepSpeed's default,
    so the partitioned norm is checked too) every rank's parameters equal a single process's dense
    step on the mean loss of both sequences."""
    from helpers import dense_loss, sequence, tiny_model
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



def test_depth_override_gives_the_config_transformers_builds_for_that_depth():
    # a deeper preset must derive its per-layer fields (Qwen2's layer_types) for the new depth,
    # exactly as transformers does when the config is built with that depth
    from transformers import Qwen2Config
    from ds_mtraining.training.model import PRESETS, model_config
    overrides = {"num_hidden_layers": 5, "hidden_size": 96}
    config = model_config({"name_or_path": "tiny-qwen2", "config_overrides": dict(overrides)})
    preset = {k: v for k, v in PRESETS["tiny-qwen2"].items() if k != "model_type"}
    reference = Qwen2Config(**{**preset, **overrides})
    assert config.layer_types == reference.layer_types and len(config.layer_types) == 5
    assert config.to_dict() == reference.to_dict()


# ----------------------------------------------------------------------------- the Ulysses baseline
ULYSSES_SEQ, ULYSSES_SEED, ULYSSES_LR = 512, 1234, 1.0


def ulysses_config(**mtraining) -> dict:
    """The CPU demo's JSON with the Ulysses mode on random tokens, one plain SGD step (lr 1, no
    clipping, no schedule): each parameter moves by exactly minus its gradient."""
    config = demo_config(**{"attention": "ulysses", "seq_len": ULYSSES_SEQ, "loss_chunk_tokens": 128,
                            "gradient_checkpointing": True, "data": {"source": "random", "samples": 8}, **mtraining})
    config.update(optimizer={"type": "SGD", "params": {"lr": ULYSSES_LR}}, gradient_clipping=0.0,
                  zero_allow_untested_optimizer=True)
    del config["scheduler"]
    return config


def _train_in_process(rank: int, root, name: str, config: dict, steps: int, seed: int) -> dict:
    """ds_mtraining.train on this spawned rank with ``config`` (rank 0 writes ROOT/NAME.json),
    ``steps`` steps from ``seed``, no checkpoint; train()'s result."""
    from ds_mtraining.train import parse_args, train
    path = Path(root) / f"{name}.json"
    if rank == 0:
        path.write_text(json.dumps(config))
    dist.barrier()
    return train(parse_args(["--deepspeed_config", str(path), "--steps", str(steps), "--seed", str(seed),
                             "--save_dir", str(Path(root) / f"run_{name}"), "--no_progress", "--no_checkpoint"]))


def _ulysses_worker(rank, world, root):
    """One step of the real training entry point in the Ulysses mode on 2 ranks (W = 2), then the
    same in a fresh run at W = 1 (2 data-parallel replicas of plain dense SDPA)."""
    results = {}
    for sp in (2, 1):
        result = _train_in_process(rank, root, f"ulysses{sp}", ulysses_config(sequence_parallel_size=sp), 1,
                                   ULYSSES_SEED)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        results[sp] = {"losses": result["losses"], "sdpa_module": ALL_ATTENTION_FUNCTIONS["sdpa"].__module__,
                       "params": {n: p.detach().clone() for n, p in result["model"].named_parameters()},
                       "attention": result["model"].config._attn_implementation}
    return results


@pytest.mark.usefixtures("built_ops")  # DeepSpeed's shm op built before the ranks start
def test_ulysses_mode_equals_the_single_process_dense_model(tmp_path):
    """``attention: "ulysses"`` through ds_mtraining.train (DeepSpeed's UlyssesSPAttentionHF over
    SDPA, contiguous shards, ZeRO-2 + CPU offload, activation checkpointing) on 2 gloo ranks: the
    loss equals the single-process dense HF model's on the whole sequence (rel 1e-5) and, after one
    SGD step with lr 1, every parameter moved by minus the dense model's gradient (fp32: atol 2e-6,
    rtol 1e-4; the loss is summed in another order: chunks of 128 tokens, two ranks). At W = 1 the
    mode is plain dense SDPA: two data-parallel replicas, each its own sample, the mean loss."""
    from helpers import dense_loss
    from ds_mtraining.data import RandomSequences, RankBatches
    from ds_mtraining.training.model import build_model
    results = run_on_ranks(_ulysses_worker, 2, str(tmp_path), timeout=TIMEOUT_S)
    run, _ = load_run_config(ulysses_config(), 2)
    samples = RandomSequences(ULYSSES_SEQ, 257, 8, ULYSSES_SEED)
    for sp, replicas in ((2, 1), (1, 2)):
        for rank in range(2):
            assert results[rank][sp]["attention"] == "sdpa"
            assert results[rank][sp]["sdpa_module"] == ("deepspeed.runtime.sequence_parallel.ulysses_sp" if sp > 1
                                                        else "transformers.integrations.sdpa_attention")
        torch.manual_seed(ULYSSES_SEED)
        model = build_model(run.model)
        batches = [RankBatches(samples, 1, data_rank=r, data_world=replicas, block_size=64,
                               seed=ULYSSES_SEED).batch(0) for r in range(replicas)]
        losses = [dense_loss(model, b["input_ids"], b["labels"]) for b in batches]
        loss = sum(losses) / replicas
        loss.backward()
        for rank in range(2):
            assert results[rank][sp]["losses"][0] == pytest.approx(loss.item(), rel=1e-5), (sp, rank)
            for name, param in model.named_parameters():
                moved = (param.detach() - results[rank][sp]["params"][name]) / ULYSSES_LR
                torch.testing.assert_close(moved, param.grad, rtol=1e-4, atol=2e-6, msg=f"W={sp} {name}")


@pytest.mark.parametrize("change, world, message", [
    (dict(sequence_parallel_size=8), 8,
     r"mtraining.model \(tiny-qwen2\): mtraining.attention='ulysses' splits the heads .* num_attention_heads=4 / "
     r"num_key_value_heads=2 cannot be split over mtraining.sequence_parallel_size=8 .*among \[1, 2, 4\]"),
    (dict(document_masking=True), 2, r"mtraining.attention='ulysses' runs HF's SDPA attention, whose Ulysses "
                                     r"wrapper drops the attention mask .* cannot mask documents"),
    (dict(ring="hierarchical"), 2, r"mtraining.attention='ulysses' has no ring .* set it to 'auto' or 'flat'"),
    (dict(keep_attention_output=True), 2, r"mtraining.attention='ulysses' runs HF's SDPA attention, which "
                                          r"recomputes .*keep_attention_output applies to MTraining's attention"),
    (dict(data={"source": "random", "passkey_fraction": 0.5}), 2,
     r"mtraining.data.passkey_fraction: random token ids have no text"),
    (dict(data={"source": "random", "document_chars": 100}), 2,
     r"mtraining.data.document_chars=100: give a positive integer, with \"source\": \"stdlib\" only"),
    (dict(data={"source": "stdlib", "samples": 4}), 2,
     r"mtraining.data.samples=4: give a positive integer, with \"source\": \"random\" only"),
    (dict(data={"source": "noise"}), 2, r"mtraining.data.source='noise' is unknown; the built-in sources are "
                                        r"\['stdlib', 'random'\]"),
])
def test_bad_ulysses_or_random_data_config_is_one_clear_error(change, world, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(ulysses_config(**change), world)


@pytest.mark.parametrize("change, expected", [
    (dict(attention="sparse", data={"source": "stdlib"}), True),  # the loader packs documents
    (dict(attention="dense", data={"source": "stdlib"}), True),
    (dict(attention="sparse"), False),  # random token ids: no documents
    (dict(data={"source": "stdlib"}), False),  # ulysses cannot mask them
    (dict(attention="sparse", data={"source": "stdlib"}, document_masking=False), False),
    (dict(attention="sparse", document_masking=True), True),
])
def test_document_masking_defaults_to_on_where_the_loader_packs_documents(change, expected):
    run, _ = load_run_config(ulysses_config(**change), 2)
    assert run.document_masking is expected


def test_bad_document_masking_setting_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"mtraining.document_masking='yes' must be true or false \(or left out"):
        load_run_config(ulysses_config(attention="sparse", document_masking="yes"), 2)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bad_liger_setting_is_one_clear_error(value):
    with pytest.raises(ConfigError, match=rf"mtraining.liger={value!r} must be 'auto' .*, true or false"):
        load_run_config(ulysses_config(liger=value), 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU side: liger-kernel needs CUDA")
def test_liger_is_off_on_cpu_with_its_reason_and_true_is_an_error():
    from ds_mtraining.training.model import build_model, use_fused_kernels
    model = build_model({"name_or_path": "tiny-qwen2", "config_overrides": {}})
    norm = type(model.model.norm)
    assert "need a CUDA GPU" in use_fused_kernels(model, "auto")
    assert use_fused_kernels(model, False) == "mtraining.liger is false"
    with pytest.raises(ConfigError, match=r"mtraining.liger=true: liger-kernel's Triton kernels need a CUDA GPU; "
                                          r"set it to 'auto' or false"):
        use_fused_kernels(model, True)
    assert type(model.model.norm) is norm  # nothing patched


# ----------------------------------------------------------------------------- random init's device
def test_random_weights_are_drawn_on_the_gpu_only_where_they_fit(monkeypatch):
    """random_init_device: the CPU for a CPU device or a checkpoint; a CUDA device when four times
    the fp32 weights fit in its memory (the 3B preset: 12.3 GiB of fp32 weights); build_model
    creates the model on the device given (the meta device stands in for a GPU here)."""
    from types import SimpleNamespace
    from ds_mtraining.training.model import build_model, count_parameters, model_config, random_init_device
    preset = {"name_or_path": "qwen2.5-3b", "config_overrides": {}}
    assert random_init_device(preset, "cpu") is None
    weights = 4 * count_parameters(model_config(preset))
    assert 12e9 < weights < 12.5e9
    for total, expected in ((4 * weights, torch.device("cuda:1")), (4 * weights - 1, None)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, t=total: SimpleNamespace(total_memory=t))
        assert random_init_device(preset, "cuda:1") == expected
    tiny = {"name_or_path": "tiny-qwen2", "config_overrides": {}}
    assert {p.device.type for p in build_model(tiny, torch.device("meta")).parameters()} == {"meta"}
    assert {p.device.type for p in build_model(tiny).parameters()} == {"cpu"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_random_weights_drawn_on_the_gpu_are_seeded():
    from ds_mtraining.training.model import build_model, random_init_device
    tiny = {"name_or_path": "tiny-qwen2", "config_overrides": {}}
    device = random_init_device(tiny, "cuda:0")
    models = []
    for _ in range(2):
        torch.manual_seed(3)
        models.append(build_model(tiny, device))
    assert device == torch.device("cuda:0") and {p.device.type for p in models[0].parameters()} == {"cuda"}
    for a, b in zip(*(m.parameters() for m in models)):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- keep_attention_output
def _keep_output_worker(rank, world, root):
    """Three steps of the real training entry point (2 gloo ranks, ZeRO-2 + CPU offload, activation
    checkpointing, the sparse ring), with and without keep_attention_output."""
    from ds_mtraining import ops
    results = {}
    real = ops.attention_forward
    for keep in (False, True):
        calls = []
        ops.attention_forward = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        result = _train_in_process(rank, root, f"keep{keep}",
                                   demo_config(gradient_checkpointing=True, keep_attention_output=keep), 3, 7)
        ops.attention_forward = real
        results[keep] = {"losses": result["losses"], "kernel_forwards": len(calls),
                         "params": {n: p.detach().clone() for n, p in result["model"].named_parameters()}}
    return results


@pytest.mark.usefixtures("built_ops")  # DeepSpeed's shm op built before the ranks start
def test_keep_attention_output_trains_bit_for_bit_like_recomputing(tmp_path):
    """mtraining.keep_attention_output through ds_mtraining.train (2 ranks, ZeRO-2 + CPU offload,
    checkpointing, fp32 on CPU): the same losses and parameters after three steps, bit for bit (the
    kept output is the one the recompute would make), with half the kernel forwards (each rank's
    ring runs W = 2 forward calls per layer and attention)."""
    from ds_mtraining.training.model import PRESETS
    results = run_on_ranks(_keep_output_worker, 2, str(tmp_path), timeout=TIMEOUT_S)
    layers = PRESETS["tiny-qwen2"]["num_hidden_layers"]
    for rank in range(2):
        off, on = results[rank][False], results[rank][True]
        assert on["losses"] == off["losses"] and len(on["losses"]) == 3
        for name, value in off["params"].items():
            assert torch.equal(on["params"][name], value), name
        assert off["kernel_forwards"] == 3 * 2 * layers * 2 and on["kernel_forwards"] == 3 * layers * 2
