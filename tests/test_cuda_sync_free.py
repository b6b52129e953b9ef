"""GPU only: MTraining attention calls (forward and backward) never synchronise with the host,
apart from the once-per-step checks (ds_mtraining.ring.agreement), which a warm-up step runs.

* one GPU: the layer (``striped_sparse_attention``), and a tiny bf16 Qwen2 (with and without
  activation checkpointing) whose attention calls and attention backward run under
  ``torch.cuda.set_sync_debug_mode("error")`` (scoped to our calls: the rest of the model, e.g.
  the embedding backward, may synchronise);
* two GPUs (NCCL, two spawned processes): the ring with the fused distributed estimator under
  the same mode, its index against the single-device fused estimator's on the whole sequence;
  with documents, a step's second document-aware estimate (what its later layers run) under
  the mode, against the torch rule on the whole sequence;
* the fused distributed estimator replayed from its CUDA graph against the eager path, on a
  group of one rank (one GPU, also against the single-device estimator) and of two.

Skipped without CUDA (the two-GPU tests without two GPUs).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from ds_mtraining import SparseConfig, synthetic
from ds_mtraining.documents import doc_start_from_cu_seqlens
from ds_mtraining.estimator.rule import estimate_vertical_slash
from ds_mtraining.layer import AttentionStats, IndexCache, MTrainingAttentionSettings, striped_sparse_attention
from ds_mtraining.layout import StripedLayout
from ds_mtraining.step import new_step
from ds_mtraining.training.memory import enable_checkpointing
from helpers import differing_entries

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CONFIG = SparseConfig(block_size=64, last_q=64)
HEAD_DIM = 64  # the CUDA kernels take 64 or 128


@contextlib.contextmanager
def sync_is_an_error():
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _qkv(seq, device, seed=0, heads=4, kv_heads=2):
    g = torch.Generator().manual_seed(seed)
    q, k = synthetic.planted_qk(seq, heads, kv_heads, HEAD_DIM, offsets=(200, 450), columns=((7, 90), (300,)))
    v = torch.randn(1, seq, kv_heads, HEAD_DIM, generator=g)
    return [t.to(device, torch.bfloat16) for t in (q, k, v)]


def _step(q, k, v, settings, positions, cache, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = striped_sparse_attention(q, k, v, settings, position_ids=positions, cache=cache)
    out.backward(dout)
    return out, q.grad, k.grad, v.grad


def test_layer_forward_and_backward_do_not_synchronise(monkeypatch):
    from ds_mtraining.estimator import fused as estimate_cuda
    fused = []
    real = estimate_cuda.estimate_vertical_slash_cuda
    monkeypatch.setattr(estimate_cuda, "estimate_vertical_slash_cuda", lambda *a, **kw: fused.append(1) or real(*a, **kw))
    q, k, v = _qkv(2048, "cuda")
    settings = MTrainingAttentionSettings(CONFIG, stats=AttentionStats())
    positions = torch.arange(2048, device="cuda")[None]
    dout = torch.randn_like(q)
    cache = IndexCache()
    new_step()
    settings.stats.reset()
    first = _step(q, k, v, settings, positions, cache, dout)  # loads the ops; the step's checks
    torch.cuda.synchronize()
    with sync_is_an_error():
        second = _step(q, k, v, settings, positions, cache, dout)
    torch.cuda.synchronize()
    assert len(fused) == 2, "the fused CUDA estimator was not used"
    for a, b in zip(first, second):
        assert torch.equal(a, b), "the second step differs from the first"
    assert settings.stats.summary()["density"] < 1.0  # read after the step: synchronises here


def _scoped_to_our_calls(monkeypatch):
    """Sync debug mode "error" inside our attention function and our autograd backwards."""
    from ds_mtraining import attention, hf
    from ds_mtraining.ring import loop

    def scoped(fn):
        def wrapped(*args, **kwargs):
            with sync_is_an_error():
                return fn(*args, **kwargs)
        return wrapped
    monkeypatch.setattr(hf, "striped_sparse_attention", scoped(hf.striped_sparse_attention))
    for cls in (attention.SparseAttentionFunction, loop.RingSparseAttentionFunction):
        monkeypatch.setattr(cls, "backward", staticmethod(scoped(cls.backward)))


def _tiny_qwen2_on_gpu(checkpointing: str | None, keep_output: bool = False):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ds_mtraining.hf import use_mtraining_attention
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=4 * HEAD_DIM, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=512, rope_theta=1e6, use_cache=False)
    model = Qwen2ForCausalLM(config).to("cuda", torch.bfloat16).train()
    settings = MTrainingAttentionSettings(CONFIG, stats=AttentionStats(), keep_output=keep_output)
    use_mtraining_attention(model, settings)
    if checkpointing is not None:
        enable_checkpointing(model, reentrant=checkpointing == "reentrant")
    return model, settings


@pytest.mark.parametrize("checkpointing, keep_output", [(None, False), ("reentrant", False), ("non-reentrant", False),
                                                        ("reentrant", True), ("non-reentrant", True)])
def test_hf_qwen2_attention_does_not_synchronise(monkeypatch, checkpointing, keep_output):
    model, settings = _tiny_qwen2_on_gpu(checkpointing, keep_output)
    ids = torch.randint(0, 512, (1, 1024), device="cuda")
    new_step()
    settings.stats.reset()
    model(input_ids=ids, labels=ids).loss.backward()  # warm-up step: op loads, the step's checks
    torch.cuda.synchronize()
    _scoped_to_our_calls(monkeypatch)
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    torch.cuda.synchronize()


@pytest.mark.parametrize("checkpointing", ["reentrant", "non-reentrant"])
def test_hf_qwen2_keep_output_on_gpu(monkeypatch, checkpointing):
    """keep_output in bf16 on a GPU: one sparse forward per layer and step instead of two, and
    every gradient within 2% in norm of the checkpointed run that recomputes attention."""
    from ds_mtraining import ops
    ids = torch.randint(0, 512, (1, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    grads, calls = {}, {}
    real = ops.attention_forward
    for keep in (False, True):
        counted = []
        monkeypatch.setattr(ops, "attention_forward", lambda *a, **kw: counted.append(1) or real(*a, **kw))
        model, settings = _tiny_qwen2_on_gpu(checkpointing, keep)
        new_step()
        settings.stats.reset()
        model(input_ids=ids, labels=ids).loss.backward()
        grads[keep] = {n: p.grad.float() for n, p in model.named_parameters()}
        calls[keep] = len(counted)
    assert calls == {False: 4, True: 2}  # 2 layers
    for name, grad in grads[False].items():
        gap = float((grads[True][name] - grad).norm() / grad.norm().clamp(min=1e-12))
        assert gap <= 2e-2, f"{name}: {gap:.3e}"


# ---------------------------------------------------------------------------- two GPUs
def _ring_worker(rank, world):
    from ds_mtraining.estimator.fused import estimate_vertical_slash_cuda
    from ds_mtraining.distributed.comm import ring_comm
    from ds_mtraining.estimator import estimate_index
    device = torch.device("cuda", rank)
    seq = 4096
    layout = StripedLayout(world, CONFIG.block_size)
    q, k, v = _qkv(seq, device)
    shards = [layout.shard(t, rank).contiguous() for t in (q, k, v)]
    positions = layout.positions(seq, rank, device=device)[None]
    settings = MTrainingAttentionSettings(CONFIG, stats=AttentionStats())
    dout = torch.randn_like(shards[0])
    cache = IndexCache()
    new_step()
    settings.stats.reset()
    first = _step(*shards, settings, positions, cache, dout)  # the step's checks run here
    torch.cuda.synchronize()
    with sync_is_an_error():
        second = _step(*shards, settings, positions, cache, dout)
        distributed = estimate_index(shards[0], shards[1], CONFIG, ring_comm(None))
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(first, second))
    differing, total = differing_entries(distributed, estimate_vertical_slash_cuda(q, k, CONFIG))
    # with documents: the first estimate of a step reads the document list, the next layers' none
    doc_start = doc_start_from_cu_seqlens(torch.tensor([0, 700, 2100, 2104, seq]), seq).to(device)
    documents_first = estimate_index(shards[0], shards[1], CONFIG, ring_comm(None), doc_start=doc_start)
    torch.cuda.synchronize()
    with sync_is_an_error():
        documents_second = estimate_index(shards[0], shards[1], CONFIG, ring_comm(None), doc_start=doc_start)
    torch.cuda.synchronize()
    documents_same = all(torch.equal(getattr(documents_first, n), getattr(documents_second, n))
                         for n in ("slash", "slash_count", "vertical", "vertical_count"))
    documents_differing, documents_total = differing_entries(
        documents_second, estimate_vertical_slash(q, k, CONFIG, doc_start=doc_start))
    return dict(same=same, differing=differing, total=total, documents_same=documents_same,
                documents_differing=documents_differing, documents_total=documents_total)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpu_ring_does_not_synchronise():
    from ds_mtraining.distributed.spawn import run_on_ranks
    results = run_on_ranks(_ring_worker, 2, timeout=240, backend="nccl")
    for rank, result in enumerate(results):
        assert result["same"], f"rank {rank}: the second step differs from the first"
        assert result["differing"] <= max(2, result["total"] // 100), (
            f"rank {rank}: the distributed fused index differs from the single-device one in "
            f"{result['differing']} of {result['total']} entries")
        assert result["documents_same"], f"rank {rank}: the document-aware index changed between layers"
        assert result["documents_differing"] <= max(2, result["documents_total"] // 100), (
            f"rank {rank}: the gathered document-aware index differs from the single-device torch rule in "
            f"{result['documents_differing']} of {result['documents_total']} entries")


def _graph_worker(rank, world):
    """The fused distributed estimator from its CUDA graph against the eager path, on inputs that
    change every call (the replay must read the new ones). On a group of one rank (one GPU: its
    collectives, the gathered selection and the graph, on NCCL) also against the single-device
    fused estimator on the same inputs."""
    from ds_mtraining.attention import resolve_softmax_scale
    from ds_mtraining.estimator.fused import estimate_vertical_slash_cuda
    from ds_mtraining.distributed.comm import RingComm
    from ds_mtraining.estimator import graphs as estimate_graph
    from ds_mtraining.estimator.distributed import estimate_vertical_slash_cuda_distributed
    device = torch.device("cuda", rank)
    layout = StripedLayout(world, CONFIG.block_size)
    comm = RingComm(None)  # ring_comm() would return None for a group of one
    scale = resolve_softmax_scale(HEAD_DIM, None)
    estimate_graph.release()
    q, k, _ = _qkv(4096, device)
    same, vs_single = [], []
    for call in range(4):
        g = torch.Generator().manual_seed(call)
        noisy = [t + 0.5 * torch.randn(t.shape, generator=g).to(device, t.dtype) for t in (q, k)]
        qs, ks = (layout.shard(t, rank).contiguous().requires_grad_() for t in noisy)  # as in training
        eager = estimate_vertical_slash_cuda_distributed(qs, ks, CONFIG, comm)
        context = sync_is_an_error() if call >= 1 else contextlib.nullcontext()  # call 0 runs eagerly
        with context:
            replayed = estimate_graph.captured_estimate(qs, ks, CONFIG, comm, scale)
        fields = ("slash", "slash_count", "vertical", "vertical_count")
        same.append(all(torch.equal(getattr(eager, f), getattr(replayed, f)) for f in fields)
                    and not any(getattr(replayed, f).requires_grad for f in fields))
        if world == 1:
            vs_single.append(differing_entries(eager, estimate_vertical_slash_cuda(*noisy, CONFIG)))
    torch.cuda.synchronize()
    return dict(same=same, captures=estimate_graph.captures(), vs_single=vs_single)


@pytest.mark.parametrize("world", [1, 2])
def test_estimator_graph_equals_the_eager_path(world):
    from ds_mtraining.distributed.spawn import run_on_ranks
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    results = run_on_ranks(_graph_worker, world, timeout=240, backend="nccl")
    for rank, result in enumerate(results):
        assert result["same"] == [True] * 4, f"rank {rank}: graph vs eager index per call: {result['same']}"
        assert result["captures"] == 1, f"rank {rank}: {result['captures']} graphs for one shape"
        for differing, total in result["vs_single"]:  # the 1% rule of the two-GPU ring test above
            assert differing <= max(2, total // 100), (
                f"group of one vs single device: {differing} of {total} entries differ")
