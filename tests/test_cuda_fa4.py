"""GPU tests of FlashAttention-4 as the dense baselines' kernel (``dense_backend: "fa4"``,
ds_mtraining/dense_backend.py). Skipped without a CUDA GPU on which FA4 runs (Hopper or Blackwell,
``flash_attn.cute`` importable: scripts/fa4_check.sh installs it on the H200).

Tolerances, by relative Frobenius error (``relative_error``), bf16 inputs:

* FA4 against float64 dense causal attention (output and dq/dk/dv, GQA): at most ``TOLERANCE``
  (2e-2, the bound of the sparse kernels' GPU tests), and at most twice torch SDPA-flash's own
  error on the same inputs plus 1e-3 (FA4 is as accurate as the baseline it replaces); the same
  for FA4's varlen path against float64 attention under the document mask;
* the dense (one GPU) and Ulysses paths with backend fa4 against the same paths with backend sdpa:
  the attention output and input gradients within ``TOLERANCE``; through a bf16 two-layer model
  (the Ulysses baseline's HF attention), the loss within 1e-2 and every parameter gradient within
  ``MODEL_TOLERANCE`` (5e-2: rounding differences propagated through two bf16 layers).

One shape family (H 16 / Hkv 2, D 128, bf16: the benchmark's) so that FA4 compiles few kernels.
"""
from __future__ import annotations

import pytest
import torch

from ds_mtraining import dense_backend
from ds_mtraining.dense_backend import dense_causal_attention, fa4_document_attention, fa4_unavailable
from ds_mtraining.documents import doc_start_from_cu_seqlens, document_causal_mask
from ds_mtraining.reference import dense_attention, outputs_and_grads

UNAVAILABLE = fa4_unavailable() if torch.cuda.is_available() else "no CUDA device"
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"FA4 cannot run here: {UNAVAILABLE}")

TOLERANCE = 2e-2
MODEL_TOLERANCE = 5e-2
HEADS, KV_HEADS, DIM = 16, 2, 128
SCALE = DIM ** -0.5


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(actual).all(), "output holds NaN or inf"
    return float((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30))


def random_inputs(batch: int, seq: int, seed: int, heads: int = HEADS, kv_heads: int = KV_HEADS, dim: int = DIM):
    """bf16 CUDA q, k, v, dout ([B, S, H, D] layout, GQA)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, seq, h, dim, generator=generator).to("cuda", torch.bfloat16)
            for h in (heads, kv_heads, kv_heads, heads)]


def causal_mask(batch: int, seq: int, heads: int = HEADS) -> torch.Tensor:
    return torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril().expand(batch, heads, seq, seq)


@pytest.fixture
def fa4_calls(monkeypatch) -> list:
    """Records each FA4 call (its module's import, once per call), so that a path said to run FA4
    is seen to."""
    calls, original = [], dense_backend._import_fa4

    def counted():
        calls.append(1)
        return original()
    monkeypatch.setattr(dense_backend, "_import_fa4", counted)
    return calls


def assert_as_accurate(fa4, sdpa, exact):
    for what, mine, baseline, truth in zip(("out", "dq", "dk", "dv"), fa4, sdpa, exact):
        error, baseline_error = relative_error(mine, truth), relative_error(baseline, truth)
        assert error <= TOLERANCE and error <= 2 * baseline_error + 1e-3, (what, error, baseline_error)


@pytest.mark.parametrize("batch, seq", [(1, 128), (2, 1000), (1, 2048)])
@pytest.mark.parametrize("heads, kv_heads, dim, strided", [
    (HEADS, KV_HEADS, DIM, False),
    (12, 2, 64, False),  # the quality studies' 61M shape
    (12, 2, 64, True),  # ... laid out as transformers hands it over: [B, H, S, D] memory seen as [B, S, H, D]
])
def test_fa4_matches_float64_causal_attention_with_gradients(batch, seq, heads, kv_heads, dim, strided):
    q, k, v, dout = random_inputs(batch, seq, seq, heads, kv_heads, dim)
    mask, scale = causal_mask(batch, seq, heads), dim ** -0.5

    def fa4_attention(*qkv):
        if strided:
            qkv = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in qkv]
        return dense_causal_attention(*qkv, scale, "fa4")
    fa4 = outputs_and_grads(fa4_attention, q, k, v, dout)
    sdpa = outputs_and_grads(lambda *t: dense_causal_attention(*t, scale, "sdpa"), q, k, v, dout)
    exact = outputs_and_grads(lambda *t: dense_attention(*t, mask, scale), q.double(), k.double(), v.double(), dout)
    assert fa4[0].dtype == torch.bfloat16 and fa4[0].shape == q.shape
    assert_as_accurate(fa4, sdpa, exact)


def test_fa4_varlen_matches_float64_attention_within_documents():
    """FA4's varlen path (bench.kernel --documents' dense row): documents of 1, 127, 128, 300 and
    the rest of 1000 tokens, each attending only within itself."""
    seq = 1000
    cu = torch.tensor([0, 1, 128, 256, 556, seq])
    q, k, v, dout = random_inputs(1, seq, 7)
    mask = document_causal_mask(doc_start_from_cu_seqlens(cu, seq).cuda())[:, None].expand(1, HEADS, seq, seq)
    lengths = cu[1:] - cu[:-1]

    def varlen(q, k, v):
        flat = [t.view(seq, t.shape[2], DIM) for t in (q, k, v)]
        return fa4_document_attention(*flat, cu.to("cuda", torch.int32), int(lengths.max()), SCALE).view(q.shape)

    fa4 = outputs_and_grads(varlen, q, k, v, dout)
    exact = outputs_and_grads(lambda *t: dense_attention(*t, mask, SCALE), q.double(), k.double(), v.double(), dout)
    for what, mine, truth in zip(("out", "dq", "dk", "dv"), fa4, exact):
        assert relative_error(mine, truth) <= TOLERANCE, what


def test_the_dense_path_with_fa4_equals_it_with_sdpa(fa4_calls):
    """``attention: "dense"`` on one GPU: striped_sparse_attention with the dense pattern runs the
    settings' kernel; fa4 and sdpa agree."""
    from ds_mtraining.layer import MTrainingAttentionSettings, striped_sparse_attention
    from ds_mtraining.static import DensePattern
    q, k, v, dout = random_inputs(1, 2048, 3)
    results = {}
    for backend in ("sdpa", "fa4"):
        settings = MTrainingAttentionSettings(pattern=DensePattern(), dense_backend=backend)
        results[backend] = outputs_and_grads(lambda *t: striped_sparse_attention(*t, settings, SCALE), q, k, v, dout)
        assert bool(fa4_calls) == (backend == "fa4")
    for what, fa4, sdpa in zip(("out", "dq", "dk", "dv"), results["fa4"], results["sdpa"]):
        assert relative_error(fa4, sdpa) <= TOLERANCE, what


def test_the_ulysses_baselines_attention_with_fa4_equals_it_with_sdpa(fa4_calls):
    """``attention: "ulysses"``: the model's attention that DeepSpeed-Ulysses calls after its
    all-to-all (at W = 1 DeepSpeed adds nothing) is FA4's with backend fa4; a bf16 two-layer
    Qwen2 with 16/2 heads of 128 gives the same loss and gradients as with SDPA."""
    pytest.importorskip("deepspeed")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ds_mtraining.hf import use_ulysses_attention
    seq = 1024
    config = Qwen2Config(vocab_size=257, hidden_size=HEADS * DIM, num_hidden_layers=2, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, intermediate_size=256, rope_theta=1e6)
    ids = torch.randint(0, 257, (1, seq + 1), generator=torch.Generator().manual_seed(0)).cuda()
    results = {}
    for backend in ("sdpa", "fa4"):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to("cuda", torch.bfloat16)
        use_ulysses_attention(model, [0], 1, seq, dense_backend=backend)
        logits = model(input_ids=ids[:, :-1], position_ids=torch.arange(seq, device="cuda")[None]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(seq, -1), ids[0, 1:])
        loss.backward()
        results[backend] = (loss.item(), {n: p.grad for n, p in model.named_parameters()})
        assert len(fa4_calls) == (config.num_hidden_layers if backend == "fa4" else 0)
    assert results["fa4"][0] == pytest.approx(results["sdpa"][0], rel=1e-2)
    for name, grad in results["sdpa"][1].items():
        assert relative_error(results["fa4"][1][name], grad) <= MODEL_TOLERANCE, name


def test_a_profiled_step_counts_fa4_kernels_as_dense_attention():
    """The training profile's kinds (bench.e2e's attention-free step subtracts "dense attention")
    take FA4's kernels by name: nearly all of one fwd+bwd's kernel time is dense attention."""
    from ds_mtraining.training.profile import kind_of
    q, k, v, dout = (t.requires_grad_() if i < 3 else t for i, t in enumerate(random_inputs(1, 8192, 5)))

    def step():
        torch.autograd.grad(dense_causal_attention(q, k, v, SCALE, "fa4"), (q, k, v), dout)

    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        step()
        torch.cuda.synchronize()
    times = {}
    for event in profiler.key_averages():
        if event.self_device_time_total > 0 and not event.is_user_annotation:
            times[event.key] = event.self_device_time_total
    attention = sum(t for name, t in times.items() if kind_of(name) == "dense attention")
    assert attention >= 0.9 * sum(times.values()), {name[:100]: kind_of(name) for name in times}
