"""Float64 dense masked attention: the independent reference every test compares against."""
from __future__ import annotations

import math

import torch


def dense_attention_with_lse(q, k, v, mask, softmax_scale=None):
    """Attention of q [B, Sq, H, D] over k, v [B, Sk, Hkv, D] restricted to ``mask``
    [B, H, Sq, Sk] (bool), computed in float64 with K/V expanded for GQA.

    Returns (out [B, Sq, H, D], lse [B, H, Sq]); rows with no visible key give out 0, lse -inf.
    """
    h, hkv = q.shape[2], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    kd = kd.repeat_interleave(h // hkv, dim=1)
    vd = vd.repeat_interleave(h // hkv, dim=1)
    logits = (qd @ kd.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = (probs @ vd).transpose(1, 2)
    return out, lse


def dense_attention(q, k, v, mask, softmax_scale=None):
    return dense_attention_with_lse(q, k, v, mask, softmax_scale)[0]


def outputs_and_grads(attention, q, k, v, dout):
    """``attention(q, k, v)``'s output and the gradients of ``(out * dout).sum()`` with respect to
    fresh leaf copies of q, k, v: what the checks compare between implementations."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v)
    out.backward(dout.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad
