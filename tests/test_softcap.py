"""Logit soft-capping (Gemma-2's ``attn_logit_softcapping`` and ``final_logit_softcapping``) on
one process: the CPU op's outputs and q/k/v gradients against float64 dense attention with the
capped logits (documents, a window, sinks, GQA, a partial last block), the chunked loss's value and
gradients against float64 cross-entropy of capped logits, and a Gemma-2 model under MTraining
(full index) against its own eager attention on the same weights. The ring's merge of capped
calls is checked in tests/test_attention.py (running out/lse over key ranks).

Caps are small against the inputs' logits, so that capping moves every result (each test checks
that it does: the tests can fail). Tolerances: fp32 kernels against float64."""
import pytest
import torch
import torch.nn.functional as F
from helpers import dense_loss, every_entry_config, ring_inputs, sequence, visible_mask

from ds_mtraining import sparse_attention
from ds_mtraining.documents import doc_start_from_cu_seqlens
from ds_mtraining.loss import token_cross_entropy_sum
from ds_mtraining.reference import dense_attention, outputs_and_grads

SEQ, BLOCK, CAP = 300, 64, 1.5
TOL = dict(atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", ["plain", "documents", "window-and-sinks"])
def test_softcap_equals_float64(cpu_op, case):
    q, k, v, dout, index = ring_inputs(SEQ, BLOCK, seed=4)
    q = q * 3  # logits of a few units: a cap of 1.5 bends most of them
    doc_start = doc_start_from_cu_seqlens(torch.tensor([0, 90, 91, SEQ]), SEQ) if case == "documents" else None
    window, sinks = (70, torch.tensor([1.0, -2.0, 0.3, 3.0])) if case == "window-and-sinks" else (None, None)
    mask = visible_mask(index, doc_start, window)

    def mine(a, b, c):
        return sparse_attention(a, b, c, index, doc_start=doc_start, window=window, sinks=sinks, softcap=CAP)

    def reference(a, b, c):
        if sinks is None:
            return dense_attention(a, b, c, mask, softcap=CAP)
        from test_sinks import sink_attention  # the sink as an extra softmax column, over capped logits
        return sink_attention(a, b, c, mask, sinks.double(), softcap=CAP)

    got = outputs_and_grads(mine, q, k, v, dout)
    want = outputs_and_grads(reference, *(t.double() for t in (q, k, v, dout)))
    uncapped = sparse_attention(q, k, v, index, doc_start=doc_start, window=window, sinks=sinks)
    assert (uncapped - got[0]).abs().max() > 0.1  # capping changes the output
    for name, mine_value, theirs in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(mine_value, theirs.float(), **TOL, msg=name)


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("nan"), True])
def test_a_softcap_that_is_no_cap_is_refused(softcap):
    q, k, v, _, index = ring_inputs(128, BLOCK)
    with pytest.raises(ValueError, match=r"^softcap must be a positive number \(the logit cap\) or None, got "):
        sparse_attention(q, k, v, index, softcap=softcap)


def test_the_loss_caps_the_lm_heads_logits():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 40, 16, generator=g), torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (2, 40), generator=g)
    labels[0, :3] = -100
    leaves = [t.clone().requires_grad_() for t in (hidden, weight)]
    total = token_cross_entropy_sum(*leaves, labels, chunk_tokens=16, softcap=2.0)
    total.backward()
    reference = [t.double().requires_grad_() for t in (hidden, weight)]
    logits = 2.0 * torch.tanh(reference[0] @ reference[1].T / 2.0)
    want = F.cross_entropy(logits.reshape(-1, 50), labels.reshape(-1), reduction="sum")
    want.backward()
    assert abs(token_cross_entropy_sum(hidden, weight, labels).item() - want.item()) > 1.0  # the cap matters
    torch.testing.assert_close(total.double(), want, rtol=1e-5, atol=1e-4)
    for name, mine, theirs in zip(("hidden", "weight"), leaves, reference):
        torch.testing.assert_close(mine.grad, theirs.grad.float(), rtol=1e-4, atol=1e-5, msg=name)


def gemma2(attn_cap, final_cap):
    """A toy Gemma-2 (local and global layers) whose queries and keys are scaled up so that its
    attention logits are of a few units, with the given caps."""
    from transformers import AutoModelForCausalLM
    from ds_mtraining.families import family, family_config
    torch.manual_seed(0)
    config = family_config(family("Gemma-2"), attn_logit_softcapping=attn_cap, final_logit_softcapping=final_cap)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(40.0)
            layer.self_attn.k_proj.weight.mul_(40.0)
    return model


def test_gemma2_under_mtraining_equals_its_eager_attention():
    from ds_mtraining.hf import use_mtraining_attention
    from ds_mtraining.layer import MTrainingAttentionSettings
    from ds_mtraining.training.model import MTrainingCausalLM
    seq = 256
    input_ids, labels = sequence(seq_len=seq)
    eager = gemma2(2.0, 1.0)
    want = dense_loss(eager, input_ids, labels)
    want.backward()
    assert abs(dense_loss(gemma2(None, None), input_ids, labels).item() - want.item()) > 1e-2  # the caps matter
    model = gemma2(2.0, 1.0)
    settings = MTrainingAttentionSettings(every_entry_config(seq, BLOCK))
    wrapper = MTrainingCausalLM(use_mtraining_attention(model, settings), None, 100)
    loss = wrapper(input_ids, labels, torch.arange(seq)[None])
    loss.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    grads = dict(eager.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-4, atol=3e-5, msg=name)
