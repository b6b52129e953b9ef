"""mtraining.memory (ds_mtraining.training.memory): the tiled MLP against the untiled one, the
checkpoint offload against no offload (in a model and in training through the real entry point),
the host check's refusal and choice, the out-of-memory line, the settings' errors.

What a CPU run cannot exercise: pinned host buffers, the side stream and the overlap of the
copies with compute (on CPU the offload copies into a separate CPU tensor, synchronously), and
liger-kernel's SwiGLU (Triton, CUDA only): the tiles wrap a module forward set on the instance
the way liger's patch sets it, here plain torch."""
import ast
import copy
import json
import os
import subprocess
import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

from ds_mtraining.distributed import run_on_ranks
from ds_mtraining.training import ConfigError
from ds_mtraining.training.memory import ALLOC_CONF, HOST_MEMORY_ENV, PIN_BACKEND, CheckpointOffload, \
    HostMemoryError, MemoryPlanError, OutOfMemory, enable_checkpointing, gpu_need_gib, out_of_memory_line, \
    plan_memory, tile_mlps, tiled_mlp
from ds_mtraining.training.run_config import load_run_config, parse_run_config
from helpers import REPO

E2E_CONFIG = REPO / "ds_configs" / "e2e_zero2_offload_bf16.json"
DEMO_CONFIG = REPO / "ds_configs" / "cpu_demo.json"
TIMEOUT_S = 240
TINY = dict(vocab_size=257, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128)


def liger_style(mlp):
    """A SwiGLU forward bound on the instance, as liger-kernel's patch binds LigerSwiGLUMLP.forward
    (here in torch: silu(gate) * up, then down)."""
    mlp.forward = types.MethodType(lambda self, x: self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)), mlp)
    return mlp


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_recomputes_each_layer_and_warns_nothing(reentrant):
    """enable_checkpointing with every FutureWarning an error (transformers 5.24 deprecates
    ``gradient_checkpointing_enable`` in each call): each decoder layer's MLP runs twice per step
    (the forward and its recompute) and the gradients equal those without checkpointing."""
    def step(checkpointing: bool):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**TINY)).double().train()
        if checkpointing:
            with warnings.catch_warnings():
                warnings.simplefilter("error", FutureWarning)
                enable_checkpointing(model, reentrant)
        calls = []
        for layer in model.model.layers:
            layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1))  # (the recompute stops inside it)
        ids = torch.randint(0, TINY["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(1))
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return len(calls), {name: param.grad for name, param in model.named_parameters()}

    (plain_calls, expected), (calls, grads) = step(False), step(True)
    assert (plain_calls, calls) == (TINY["num_hidden_layers"], 2 * TINY["num_hidden_layers"])
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-12, msg=name)


def test_the_project_enables_checkpointing_only_through_one_function():
    """No call of the deprecated name in the package, its scripts, examples or tests but
    enable_checkpointing's own fallback (for transformers 5.17)."""
    calls = []
    for folder in ("ds_mtraining", "scripts", "examples", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "gradient_checkpointing_enable"):
                    calls.append(str(path.relative_to(REPO)))
    assert calls == ["ds_mtraining/training/memory.py"]


@pytest.mark.parametrize("style", ["hf", "liger_style"])
@pytest.mark.parametrize("chunk", [16, 48, 1000])  # 20, 7 (the last one short) and 1 chunks of 320 tokens
def test_tiled_mlp_forward_and_gradients_equal_untiled(style, chunk):
    """HF's Qwen2 MLP (float64) over [2, 160] tokens: the tiled output and the gradients of the input
    and of all three weights equal the untiled ones (atol 1e-12: only the weight gradients' sums run
    in another order)."""
    torch.manual_seed(0)
    reference = Qwen2MLP(Qwen2Config(**TINY)).double()
    tiled = copy.deepcopy(reference)
    if style == "liger_style":
        liger_style(reference), liger_style(tiled)
    x = torch.randn(2, 160, 64, dtype=torch.float64, requires_grad=True)
    x_tiled = x.detach().clone().requires_grad_(True)
    grad_out = torch.randn(2, 160, 64, dtype=torch.float64)
    expected = reference(x)
    expected.backward(grad_out)
    forward = tiled.forward
    got = tiled_mlp(lambda module, piece: forward(piece), tiled, x_tiled, chunk)
    got.backward(grad_out)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(x_tiled.grad, x.grad, atol=1e-12, rtol=0)
    for (name, param), ref in zip(tiled.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, atol=1e-12, rtol=0, msg=name)


def _mlp_rows(model) -> dict:
    """Counts the token rows every MLP forward computes (hooked under the tiles)."""
    rows = {"n": 0}
    for layer in model.model.layers:
        inner = layer.mlp.forward

        def count(x, _inner=inner):
            rows["n"] += x.numel() // x.shape[-1]
            return _inner(x)
        layer.mlp.forward = count
    return rows


def tiny_model(layers: int = 3):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**{**TINY, "num_hidden_layers": layers})).double().train()
    enable_checkpointing(model)
    return model


def _step(model, ids, offload=None):
    """One forward and backward of the decoder stack; (output, {name: grad})."""
    with offload if offload is not None else torch.enable_grad():
        out = model.model(input_ids=ids, use_cache=False).last_hidden_state
        (out ** 2).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_tiled_model_under_checkpointing_runs_each_mlp_twice_like_untiled():
    """A 3-layer Qwen2 (float64, non-reentrant activation checkpointing) with tiled MLPs: output and
    every gradient equal the untiled model's (atol 1e-12), and each MLP computes its tokens twice
    per step (the forward and the backward's chunks), as the untiled MLP does (the forward and the
    recompute): the recompute stops at the tiled MLP's saved input. DeepSpeed's TiledMLP computes
    them three times."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    ids = torch.randint(0, 257, (2, 100), generator=torch.Generator().manual_seed(1))
    reference = tiny_model()
    untiled_rows = _mlp_rows(reference)
    expected, expected_grads = _step(reference, ids)
    model = tiny_model()
    rows = _mlp_rows(model)
    assert tile_mlps(model, 48) == 3
    out, grads = _step(model, ids)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-12, rtol=0, msg=name)
    assert untiled_rows["n"] == rows["n"] == 2 * 200 * 3
    deepspeed_model = tiny_model()
    deepspeed_rows = _mlp_rows(deepspeed_model)
    for layer in deepspeed_model.model.layers:
        inner = layer.mlp.forward
        layer.mlp.forward = lambda x, _inner=inner, _mlp=layer.mlp: TiledMLP.apply(
            lambda module, piece: _inner(piece), _mlp, x, 5, list(_mlp.parameters()))
    _step(deepspeed_model, ids)
    assert deepspeed_rows["n"] == 3 * 200 * 3


def test_offload_restores_each_layer_once_prefetched_and_keeps_none():
    """CheckpointOffload of the first 2 of 3 layers' checkpointed inputs (CPU: copies into separate
    tensors): output and gradients bit for bit those without offload; both offloaded inputs
    restored, the second one by the prefetch started at the kept layer's restore; after the
    backward no restored tensor is held (DeepSpeed's own class holds every layer's until its
    context exits)."""
    from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload
    ids = torch.randint(0, 257, (2, 100), generator=torch.Generator().manual_seed(1))
    expected, expected_grads = _step(tiny_model(), ids)
    offload = CheckpointOffload(2, 3, cuda=False)
    prefetched = []
    real = offload._prefetch_before
    offload._prefetch_before = lambda tensor_id: (real(tensor_id), prefetched.append(sorted(offload._prefetched)))
    model = tiny_model()
    tile_mlps(model, 64)  # both tools together, as training uses them
    with offload:
        out = model.model(input_ids=ids, use_cache=False).last_hidden_state
        assert sorted(offload._tracker) == [1, 2] and list(offload._keep_last) == [3]
        (out ** 2).sum().backward()
        assert not offload._restored and not offload._prefetched and not offload._tracker
    assert torch.equal(out.detach(), expected)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-12, rtol=0, msg=name)
    stats = offload.stats
    assert (stats.offloaded_tensors, stats.restored_tensors, stats.kept_last_tensors) == (2, 2, 1)
    assert stats.offloaded_bytes == 2 * 2 * 100 * 64 * 8
    assert prefetched[0] == [2]  # the kept layer 3's restore fetched layer 2's input ahead
    with pytest.raises(ValueError, match="give 1 .. 2"):
        CheckpointOffload(3, 3, cuda=False)

    class Plain(CheckpointHiddenStatesOffload):  # DeepSpeed's, made to copy on CPU
        def _should_skip(self, tensor):
            return isinstance(tensor, torch.nn.Parameter)
    theirs = Plain(use_pin_memory=False, use_streams=False, keep_last_count=1)
    with theirs:
        (tiny_model().model(input_ids=ids, use_cache=False).last_hidden_state ** 2).sum().backward()
        assert len(theirs._restored) == 3


# ----------------------------------------------------------------------------- settings and the host check
@pytest.fixture(autouse=True)
def allocator_environment(monkeypatch):
    """A plan for CUDA sets PYTORCH_CUDA_ALLOC_CONF, and may set DS_PIN_MEMORY_BACKEND, in this
    process: each test starts without them (and without a plan's record of them) and leaves neither behind."""
    from ds_mtraining.training import memory
    monkeypatch.setattr(memory, "SET_BY_PLAN", {})
    for name in (ALLOC_CONF, PIN_BACKEND):
        monkeypatch.setenv(name, "")  # (recorded as unset, so that the end of the test unsets it)
        monkeypatch.delenv(name)


def e2e_run(seq_len: int, **memory):
    config = json.loads(E2E_CONFIG.read_text())
    config["mtraining"].update(seq_len=seq_len, sequence_parallel_size=1, memory=memory)
    run, ds_config = load_run_config(config, 1)
    return run, ds_config


@pytest.mark.parametrize("memory, checkpointing, message", [
    ({"tiled": True}, True, r"unknown key\(s\) \['tiled'\] in 'mtraining.memory'"),
    ({"tiled_mlp": "yes"}, True, r"mtraining.memory.tiled_mlp='yes' must be 'auto'"),
    ({"mlp_chunk_tokens": 0}, True, r"mtraining.memory.mlp_chunk_tokens=0 must be a positive integer"),
    ({"offload_checkpoints": -1}, True, r"offload_checkpoints=-1 must be 'auto'"),
    ({"offload_checkpoints": "all"}, False, r"checkpointing is off: set mtraining.gradient_checkpointing"),
    ({"host_reserve_gib": -2}, True, r"host_reserve_gib=-2 must be 'auto'"),
    ({"expandable_segments": "on"}, True, r"expandable_segments='on' must be true or false"),
])
def test_bad_memory_setting_is_one_clear_error(memory, checkpointing, message):
    section = dict(json.loads(DEMO_CONFIG.read_text())["mtraining"], gradient_checkpointing=checkpointing,
                   memory=memory)
    with pytest.raises(ConfigError, match=message):
        parse_run_config(section, 2)


def test_host_check_chooses_n_and_refuses_with_the_numbers(monkeypatch):
    """The Qwen2.5-3B shape at 1M tokens on one GPU (bf16, ZeRO-2 + CPU AdamW, pinned): 3.09B
    parameters x 18 bytes = 51.7 GiB of optimizer; a checkpointed input is 1M x 2048 x 2 bytes =
    4 GiB. With 125 GiB available (HOST_MEMORY_ENV), 3.5 GiB for the process and an 8 GiB reserve,
    the host holds (125 - 51.7 - 3.5 - 8) // 4 = 15 layers. On a 139.8 GiB GPU auto offloads the
    fewest layers whose GPU estimate fits: 15 at 1M (21 x 4 GiB + 1 layer's copy + 6.5 GiB of weights
    and buckets + 33.0 GiB of transients = 127.5 GiB predicted, x 1.05 + 4 = 137.9; 142.1 with 14),
    none at 256K. Where torch's host allocator cannot be told to keep pinned blocks at their size
    (before 2.13), DeepSpeed's own pinning (DS_PIN_MEMORY_BACKEND=native) does it where the process
    may lock memory; where it may not, DeepSpeed's three pinned blocks take 16 + 16 + 8 GiB for
    11.5 + 11.5 + 5.7: 63.0 GiB, the host holds 12, and the run stops with one line naming the
    numbers (an explicit offload_checkpoints of 12 tries anyway). At 4M even every layer offloaded
    leaves the GPU's estimate too large, one line too; 40 GiB of host refuses before anything else;
    16 layers given refuses naming 15."""
    from ds_mtraining.training import memory
    monkeypatch.setattr(memory, "exact_pinned_supported", lambda: True)
    monkeypatch.setenv(HOST_MEMORY_ENV, "125")
    run, ds_config = e2e_run(1 << 20, host_reserve_gib=8)
    plan = plan_memory(run, ds_config, 1, cuda=True, gpu_gib=139.8)
    assert plan.parameters == 3_085_938_688 and plan.tiled_mlp and plan.tokens_per_rank == 1 << 20
    assert plan.host["optimizer_gib"] == pytest.approx(3_085_938_688 * 18 / 2 ** 30) and plan.host["pinned_exact"]
    assert plan.offload_layers == 15 and plan.gpu["checkpoint_layer_gib"] == 4.0 and plan.gpu_total_gib == 139.8
    assert plan.gpu["checkpoint_layers_on_gpu"] == 21
    assert gpu_need_gib(plan.gpu, plan.transients) == pytest.approx(137.9, abs=0.05)
    assert plan.predicted["gpu_peak_gib"] == pytest.approx((137.9 - 4) / 1.05, abs=0.05)
    assert plan.predicted["host_peak_gib"] == pytest.approx(3_085_938_688 * 18 / 2 ** 30 + 60 + 3.5)
    line = plan.describe()
    assert line == ("ds_mtraining: memory: tiled MLP (16384-token chunks); checkpoints of the first 15 of 36 layers "
                    "to pinned host memory (auto: the GPU estimate 137.9 of 139.8 GiB; the host holds 15); host: "
                    "optimizer 51.7 + checkpoints 60.0 + processes 3.5 + reserve 8.0 of 125.0 GiB available "
                    "(DS_MTRAINING_HOST_MEMORY_GIB); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,"
                    "pinned_max_round_threshold_mb:64 (set by ds_mtraining; set the variable to choose another); "
                    "pinned blocks at their size (pinned_max_round_threshold_mb:64)"), line
    assert os.environ[ALLOC_CONF] == "expandable_segments:True,pinned_max_round_threshold_mb:64"
    assert plan_memory(e2e_run(1 << 18)[0], ds_config, 1, cuda=True, gpu_gib=139.8).offload_layers == 0

    # each plan below replaces the settings the one before it put in this process's environment
    monkeypatch.setattr(memory, "exact_pinned_supported", lambda: False)  # (torch 2.11, as on the GPU machines)
    monkeypatch.setattr(memory, "can_lock_memory", lambda: True)  # DeepSpeed's own pinning, at the size asked
    native = plan_memory(run, ds_config, 1, cuda=True, gpu_gib=139.8)
    assert native.offload_layers == 15 and native.host["pinned_exact"] and os.environ[PIN_BACKEND] == "native"
    assert os.environ[ALLOC_CONF] == "expandable_segments:True"  # without the key that torch 2.11 refuses
    assert native.describe().endswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set by ds_mtraining; set the "
                                      "variable to choose another); pinned blocks at their size "
                                      "(DS_PIN_MEMORY_BACKEND=native, DeepSpeed's, set by ds_mtraining)")
    monkeypatch.setattr(memory, "can_lock_memory", lambda: False)
    rounded = 3_085_938_688 * 8 / 2 ** 30 + 16 + 16 + 8
    with pytest.raises(HostMemoryError, match=(
            r"^host memory: at 1048576 tokens per rank the GPU needs the checkpoints of 15 layers offloaded \(with "
            r"12, the host's most, its estimate is 150.5 > 139.8 GiB\), and the CPU optimizer needs 63.0 GiB \(3.09B "
            r"parameters x 18 bytes x 1/1 ranks on this node, pinned blocks at the next power of two\), 15 offloaded "
            r"layer checkpoints 60.0 GiB, the processes 3.5 GiB, reserve 8.0 GiB .*: 134.5 GiB > 125.0 GiB available "
            r"\(DS_MTRAINING_HOST_MEMORY_GIB\); use a shorter seq_len, .* or set mtraining.memory.offload_checkpoints "
            r"to 12 to try anyway$")):
        plan_memory(run, ds_config, 1, cuda=True, gpu_gib=139.8)
    assert os.environ[ALLOC_CONF] == "expandable_segments:True" and PIN_BACKEND not in os.environ
    tried = plan_memory(e2e_run(1 << 20, host_reserve_gib=8, offload_checkpoints=12)[0], ds_config, 1, cuda=True,
                        gpu_gib=139.8)
    assert tried.offload_layers == 12 and tried.host["optimizer_gib"] == pytest.approx(rounded)  # the user's N
    memory.SET_BY_PLAN.clear()  # the user's own choices, as made before the process started
    monkeypatch.setenv(ALLOC_CONF, "pinned_max_round_threshold_mb:32")
    assert plan_memory(run, ds_config, 1, cuda=True, gpu_gib=139.8).host["pinned_exact"]
    monkeypatch.setenv(ALLOC_CONF, "expandable_segments:True")
    monkeypatch.setenv(PIN_BACKEND, "native")
    assert plan_memory(run, ds_config, 1, cuda=True, gpu_gib=139.8).host["pinned_exact"]
    monkeypatch.delenv(ALLOC_CONF)
    monkeypatch.delenv(PIN_BACKEND)

    monkeypatch.setattr(memory, "exact_pinned_supported", lambda: True)
    with pytest.raises(MemoryPlanError, match=r"^GPU memory: at 4194304 tokens per rank the GPU estimate is .* > 139.8 "
                                              r"GiB even with the checkpoints of 35 of 36 layers offloaded; use a "
                                              r"shorter seq_len or more ranks \(sequence parallel\)$"):
        monkeypatch.setenv(HOST_MEMORY_ENV, "1000")
        plan_memory(e2e_run(1 << 22)[0], ds_config, 1, cuda=True, gpu_gib=139.8)
    monkeypatch.setenv(HOST_MEMORY_ENV, "40")
    with pytest.raises(HostMemoryError, match=r"^host memory: the CPU optimizer needs 51.7 GiB \(3.09B parameters "
                                              r"x 18 bytes x 1/1 ranks on this node\), 0 offloaded layer checkpoints "
                                              r"0.0 GiB, the processes 3.5 GiB, reserve 8.0 GiB .*: 63.2 GiB > 40.0 GiB "
                                              r"available \(DS_MTRAINING_HOST_MEMORY_GIB\); use a host with more "
                                              r"memory"):
        plan_memory(run, ds_config, 1, cuda=True)
    monkeypatch.setenv(HOST_MEMORY_ENV, "125")
    run, ds_config = e2e_run(1 << 20, host_reserve_gib=8, offload_checkpoints=16)
    with pytest.raises(HostMemoryError, match=r"set mtraining.memory.offload_checkpoints to at most 15"):
        plan_memory(run, ds_config, 1, cuda=True)
    run, ds_config = e2e_run(1 << 20, offload_checkpoints="all", tiled_mlp=False)
    monkeypatch.setenv(HOST_MEMORY_ENV, "1000")
    plan = plan_memory(run, ds_config, 1, cuda=True)
    assert plan.offload_layers == 35 and not plan.tiled_mlp
    assert plan_memory(e2e_run(1 << 20)[0], ds_config, 1, cuda=False).offload_layers == 0  # auto: CUDA only


def test_plan_predicts_the_peaks_measured_at_768k(monkeypatch):
    """The plan against the measured record (capacity_h200_2026-12-03.json, 768K on one H200, a torch
    that rounded pinned blocks): its predicted GPU and host peaks within 5% of the measured ones,
    with the same offload choice."""
    from ds_mtraining.training import memory
    measured = json.loads((REPO / "benchmarks" / "results" / "capacity_h200_2026-12-03.json").read_text())
    row = measured["models"]["qwen2.5-3b"]["mtraining"]["lengths"]["786432"]
    monkeypatch.setattr(memory, "exact_pinned_supported", lambda: False)
    monkeypatch.setattr(memory, "can_lock_memory", lambda: False)
    monkeypatch.setenv(HOST_MEMORY_ENV, str(row["plan"]["host"]["available_gib"]))
    run, ds_config = e2e_run(786432)
    plan = plan_memory(run, ds_config, 1, cuda=True, gpu_gib=139.8)
    assert plan.offload_layers == row["plan"]["offload_layers"] == 5
    gpu, host = max(row["peak_memory_gib"]), row["host_peak_rss_gib"]
    assert abs(plan.predicted["gpu_peak_gib"] / gpu - 1) < 0.05, (plan.predicted, gpu)
    assert abs(plan.predicted["host_peak_gib"] / host - 1) < 0.05, (plan.predicted, host)


@pytest.mark.parametrize("checkpointing, offload, expected", [
    (False, "auto", "no activation checkpoints (mtraining.gradient_checkpointing false)"),
    (True, "auto", "checkpoints in memory (auto: off without CUDA)"),
    (True, "none", "checkpoints in memory (none)"),
    (True, 1, "checkpoints of the first 1 of 2 layers to host memory (CPU: plain copies) (offload_checkpoints=1)")])
def test_a_cpu_run_says_no_gpu_in_its_memory_line(monkeypatch, checkpointing, offload, expected):
    """The demo's run (2 layers) as on a machine without a GPU: no GPU in the line, whatever the
    settings; each says where the checkpoints are, or that there are none."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    section = dict(json.loads(DEMO_CONFIG.read_text())["mtraining"], gradient_checkpointing=checkpointing,
                   memory={"offload_checkpoints": offload})
    config = dict(json.loads(DEMO_CONFIG.read_text()), mtraining=section)
    run, ds_config = load_run_config(config, 2)
    line = plan_memory(run, ds_config, 2).describe()
    assert line.startswith(f"ds_mtraining: memory: MLP untiled; {expected}; host: ") and "GPU" not in line, line
    assert line.endswith("; no CUDA allocator (CPU)")


def test_cli_refuses_a_host_too_small_in_one_line(tmp_path):
    """The entry point with HOST_MEMORY_ENV=20 (GiB) and the 3B shape: exit 2 with one line naming
    the numbers, before any process group (no second rank needed)."""
    config = json.loads(E2E_CONFIG.read_text())
    config["mtraining"].update(sequence_parallel_size=1)
    path = tmp_path / "big.json"
    path.write_text(json.dumps(config))
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get(
        "PYTHONPATH", "")]), **{HOST_MEMORY_ENV: "20"})
    result = subprocess.run([sys.executable, "-m", "ds_mtraining.train", "--deepspeed_config", str(path)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ds_mtraining.train: configuration error: host memory: the CPU optimizer needs 51.7 GiB")
    assert "> 20.0 GiB available (DS_MTRAINING_HOST_MEMORY_GIB)" in last


def test_out_of_memory_line_names_length_peak_and_setting(monkeypatch):
    run, ds_config = e2e_run(1 << 20, host_reserve_gib=8)
    monkeypatch.setenv(HOST_MEMORY_ENV, "125")
    plan = plan_memory(run, ds_config, 1, cuda=True, gpu_gib=139.8)
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 10.75 GiB. GPU 0 has a total capacity "
                                   "of 139.80 GiB of which 1.2 GiB is free.")
    line = out_of_memory_line(error, run, plan, 2)
    assert line.startswith("CUDA out of memory at step 2 with seq_len 1048576 (1048576 tokens per GPU): ")
    assert "(Tried to allocate 10.75 GiB); set mtraining.memory.offload_checkpoints above 15 (of 36" in line
    assert "\n" not in line


# ----------------------------------------------------------------------------- training through the entry point
def demo_config(**mtraining) -> dict:
    config = json.loads(DEMO_CONFIG.read_text())
    config["mtraining"].update(seq_len=512, gradient_checkpointing=True, **mtraining)
    return config


def _memory_worker(rank, world, root):
    """Three steps of ds_mtraining.train (2 gloo ranks, ZeRO-2 + CPU offload, checkpointing, the
    sparse ring) without the memory tools and with both (64-token MLP chunks of 256 local tokens,
    layer 0's input offloaded), then a run whose second backward raises a fake CUDA OOM."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from test_training import _train_in_process
    results = {}
    for name, memory in (("off", {"tiled_mlp": False, "offload_checkpoints": "none"}),
                         ("on", {"tiled_mlp": True, "mlp_chunk_tokens": 64, "offload_checkpoints": 1})):
        result = _train_in_process(rank, root, name, demo_config(memory=memory), 3, 7)
        results[name] = {"losses": result["losses"],
                         "params": {n: p.detach().clone() for n, p in result["model"].named_parameters()}}
    real, calls = DeepSpeedEngine.backward, []

    def backward(self, loss, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 10.75 GiB. GPU 0 ...")
        return real(self, loss, *args, **kwargs)
    DeepSpeedEngine.backward = backward
    try:
        _train_in_process(rank, root, "oom", demo_config(memory={"offload_checkpoints": 1}), 3, 7)
    except OutOfMemory as error:
        results["oom"] = str(error)
    finally:
        DeepSpeedEngine.backward = real
    return results


@pytest.mark.usefixtures("built_ops")  # DeepSpeed's shm op built before the ranks start
def test_training_with_memory_tools_equals_training_without(tmp_path):
    """Through ds_mtraining.train on 2 ranks (fp32 on CPU), three steps with the tiled MLP and the
    offloaded checkpoint: losses within rel 1e-6 and parameters within atol 1e-6 of the run
    without (the tiles sum the MLP's weight gradients chunk by chunk: another order of fp32
    additions; AdamW's first steps scale any difference up to lr). A fake CUDA OOM in the second
    step ends the run with the one line."""
    results = run_on_ranks(_memory_worker, 2, str(tmp_path), timeout=TIMEOUT_S)
    for rank in range(2):
        off, on = results[rank]["off"], results[rank]["on"]
        assert len(on["losses"]) == 3
        assert on["losses"] == pytest.approx(off["losses"], rel=1e-6)
        for name, value in off["params"].items():
            torch.testing.assert_close(on["params"][name], value, atol=1e-6, rtol=0, msg=name)
        assert results[rank]["oom"].startswith("CUDA out of memory at step 2 with seq_len 512 (256 tokens per GPU): "
                                               "no CUDA peak to report (Tried to allocate 10.75 GiB); "), results[rank]
    plan = json.loads((tmp_path / "run_on" / "memory_plan.json").read_text())
    assert plan["tiled_mlp"] and plan["offload_layers"] == 1 and plan["tokens_per_rank"] == 256


def test_loss_never_holds_sequence_by_vocabulary():
    """The chunked loss, forward and backward, over 4096 tokens and a 1000-word vocabulary with
    512-row chunks: no tensor any op returns reaches S x V elements (the largest is one chunk's
    [512, 1000] logits; the weight's gradient is [V, D]). Liger's fused loss (CUDA) chunks the same
    way inside its kernels; a CPU run cannot watch it."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from ds_mtraining.loss import token_cross_entropy_sum

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(tensor, torch.Tensor):
                    Largest.numel = max(Largest.numel, tensor.numel())
            return out
    seq, vocab, hidden = 4096, 1000, 32
    g = torch.Generator().manual_seed(0)
    states = torch.randn(seq, hidden, generator=g, requires_grad=True)
    weight = torch.randn(vocab, hidden, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (seq,), generator=g)
    with Largest():
        token_cross_entropy_sum(states, weight, labels, chunk_tokens=512).backward()
    assert Largest.numel == 512 * vocab < seq * vocab
