"""GPU only: mtraining.liger (liger-kernel's fused RMSNorm, RoPE and SwiGLU on a HF model,
:func:`ds_mtraining.training.model.use_fused_kernels`, and its fused linear cross-entropy as the
loss) against the model's own eager modules and the chunked torch loss, through MTraining's CUDA
attention, and the fused loss against float64. Skipped without CUDA or without liger-kernel."""
import copy

import pytest
import torch
from helpers import MODELS, SMALL, every_entry_config, sequence

from ds_mtraining import hf
from ds_mtraining.layer import MTrainingAttentionSettings
from ds_mtraining.training.model import MTrainingCausalLM, use_fused_kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="liger-kernel's Triton kernels need a CUDA GPU")

SEQ, BLOCK = 512, 64  # helpers.sequence()'s length; a block the CUDA kernels take
FULL = every_entry_config(SEQ, BLOCK)


@pytest.mark.parametrize("kind", MODELS)
def test_liger_kernels_match_the_eager_model_on_gpu(kind, monkeypatch):
    """mtraining.liger on a bf16 GPU model: the loss and every gradient match the model's own
    eager RMSNorm/RoPE/SwiGLU (bf16: loss within 1%, each gradient within 5% in norm), and the
    attention still gets q/k/v in [B, S, H, D] (liger's RoPE works in place in that layout)."""
    pytest.importorskip("liger_kernel")
    layouts = []
    forward = hf.mtraining_attention_forward

    def spy(module, query, key, value, *args, **kwargs):
        layouts.append(all(t.transpose(1, 2).is_contiguous() for t in (query, key, value)))
        return forward(module, query, key, value, *args, **kwargs)
    monkeypatch.setitem(hf.AttentionInterface._global_mapping, hf.ATTENTION_NAME, spy)
    config_class, model_class, extra = MODELS[kind]
    torch.manual_seed(0)  # head_dim 64: the CUDA kernels take 64 or 128
    eager = model_class(config_class(**{**SMALL, "hidden_size": 256, "intermediate_size": 512}, **extra,
                                     attn_implementation="eager")).to("cuda", torch.bfloat16)
    fused = copy.deepcopy(eager)
    assert use_fused_kernels(fused, True) is None
    input_ids, labels = (t.cuda() for t in sequence(batch=1))
    results = []
    for model, fused_loss in ((eager, False), (fused, True)):
        hf.use_mtraining_attention(model, MTrainingAttentionSettings(FULL))
        loss = MTrainingCausalLM(model, None, loss_chunk_tokens=SEQ, fused_loss=fused_loss)(
            input_ids, labels, torch.arange(SEQ, device="cuda")[None])
        loss.backward()
        results.append((loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (eager_loss, eager_grads), (fused_loss, fused_grads) = results
    assert fused_loss == pytest.approx(eager_loss, rel=1e-2)
    for name, grad in eager_grads.items():
        gap = (fused_grads[name] - grad).norm() / grad.norm().clamp(min=1e-12)
        assert gap <= 5e-2, f"{kind} {name}: gradient differs by {gap:.3f} in norm"
    assert layouts and all(layouts)


@pytest.mark.parametrize("softcap", [None, 1.5], ids=["no-cap", "softcap"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
def test_gpu_loss_matches_float64(dtype, tol, fused, softcap):
    """token_cross_entropy_sum on CUDA, fused (liger's fused linear cross-entropy) and chunked,
    against float64 full-logit cross-entropy of the same (rounded) inputs: the sum and both
    gradients under a non-unit upstream gradient, with ignored labels; relative error <= 1e-4 in
    fp32 and <= 1e-2 in bf16 (norm for gradients; the fused loss's bf16 weight gradient was 1.1%
    off until it accumulated in fp32). With ``softcap`` the logits are soft-capped (Gemma-2's
    final_logit_softcapping) on both sides."""
    pytest.importorskip("liger_kernel")
    from ds_mtraining.loss import IGNORE_INDEX, token_cross_entropy_sum
    generator = torch.Generator().manual_seed(0)
    tokens, dim, vocab = 3000, 64, 5000  # several of liger's chunks, a ragged last one
    hidden = torch.randn(2, tokens // 2, dim, generator=generator)
    weight = torch.randn(vocab, dim, generator=generator) / dim ** 0.5
    labels = torch.randint(0, vocab, (2, tokens // 2), generator=generator)
    labels[0, :11] = IGNORE_INDEX
    hidden, weight = hidden.to(dtype), weight.to(dtype)  # the reference sees the same rounded inputs
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logits = h64 @ w64.T if softcap is None else softcap * torch.tanh(h64 @ w64.T / softcap)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1),
                                                 ignore_index=IGNORE_INDEX, reduction="sum")
    (expected * 0.5).backward()
    h, w = hidden.cuda().requires_grad_(), weight.cuda().requires_grad_()
    total = token_cross_entropy_sum(h, w, labels.cuda(), chunk_tokens=1024, fused=fused, softcap=softcap)
    (total * 0.5).backward()
    assert abs(total.item() - expected.item()) <= tol * abs(expected.item())
    for name, got, want in (("hidden", h.grad, h64.grad), ("weight", w.grad, w64.grad)):
        gap = float((got.double().cpu() - want).norm() / want.norm())
        assert gap <= tol, f"{dtype} grad of {name} differs by {gap:.2e} in norm"


@pytest.mark.parametrize("backend", ["sdpa", "fa4"])
@pytest.mark.parametrize("liger", ["auto", False], ids=["liger", "no-liger"])
def test_the_dense_training_path_matches_the_float32_model(backend, liger):
    """What ``attention: "dense"`` trains on one GPU (the quality studies' dense stages and arms):
    bf16, the dense pattern through the resolved kernel (SDPA or FA4), liger's kernels and fused
    loss where on, at the studies' head shape (12 query / 2 key-value heads of 64), against the
    same weights in float32 under transformers' SDPA with torch's cross-entropy: the loss within 1%,
    every gradient within 5% in norm (bf16's rounding gives 1-3% on this shape; a wrong key or value gradient
    is off by far more)."""
    from ds_mtraining.dense_backend import fa4_unavailable
    from ds_mtraining.static import DensePattern
    if backend == "fa4" and fa4_unavailable():
        pytest.skip(f"FA4 cannot run here: {fa4_unavailable()}")
    if liger == "auto":
        pytest.importorskip("liger_kernel")
    config_class, model_class, extra = MODELS["qwen2"]
    torch.manual_seed(0)
    shape = dict(SMALL, hidden_size=768, num_attention_heads=12, num_key_value_heads=2, intermediate_size=512)
    reference = model_class(config_class(**shape, **extra, attn_implementation="sdpa")).cuda()
    trained = copy.deepcopy(reference).to(torch.bfloat16)
    assert use_fused_kernels(trained, liger) is None or liger is False
    input_ids, labels = (t.cuda() for t in sequence(batch=2))
    logits = reference(input_ids=input_ids).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    expected.backward()
    hf.use_mtraining_attention(trained, MTrainingAttentionSettings(pattern=DensePattern(), dense_backend=backend))
    loss = MTrainingCausalLM(trained, None, loss_chunk_tokens=SEQ, fused_loss=liger == "auto")(
        input_ids, labels, torch.arange(SEQ, device="cuda")[None].expand(2, -1))
    loss.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-2)
    for name, param in reference.named_parameters():
        got = dict(trained.named_parameters())[name].grad.float()
        gap = (got - param.grad).norm() / param.grad.norm().clamp(min=1e-12)
        assert gap <= 5e-2, f"{backend} liger={liger} {name}: gradient differs by {gap:.3f} in norm"
