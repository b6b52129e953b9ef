"""The Ulysses drop-in ``ds_mtraining.layer.DistributedAttention`` against DeepSpeed's own
``deepspeed.sequence.layer.DistributedAttention`` and float64 dense attention.

With a sparse config that selects everything (top-p 1.0, caps >= S) MTraining attention is dense
causal attention, so on the same inputs it must give Ulysses' outputs and gradients (Ulysses
running causal SDPA as its local attention): fp32 on both sides, compared with a norm-relative
tolerance of 1e-5. Every call form runs on contiguous shards (Ulysses' own inputs, re-striped
inside) and on block-striped shards (``input_layout="striped"``), batch- and sequence-first.
One spawned gloo group per world size (2 and 4) runs all cases; errors that need no group run
in-process.
"""
import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_mtraining import SparseConfig
from ds_mtraining.distributed.spawn import run_on_ranks
from ds_mtraining.layer import DistributedAttention, LayoutError
from ds_mtraining.reference import dense_attention
from ds_mtraining.layout import StripedLayout

BLOCK, BATCH, HEADS, KV_HEADS, DIM = 64, 2, 8, 4, 16
# W=2: 3 blocks per rank; W=4: 2 blocks per rank: the re-stripe's splits are uneven and some empty
SEQ = {2: 384, 4: 512}
SCALE = 0.3
TIMEOUT_S = 240
REL_TOL = 1e-5      # fp32 ring vs fp32 Ulysses + SDPA, ||a - b|| / ||b||
DENSE_TOL = dict(rtol=1e-4, atol=1e-5)  # fp32 ring vs float64 dense


def full_config(seq_len: int) -> SparseConfig:
    """Selects every causal entry: sparse attention == dense causal attention."""
    return SparseConfig(block_size=BLOCK, p_vertical=1.0, p_slash=1.0, max_vertical=seq_len,
                        max_slash_diagonals=seq_len)


def global_inputs(seq_len: int, seed: int = 0):
    """q, k, v, dout [B, S, heads, D] (batch-first, whole sequence), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(BATCH, seq_len, HEADS, DIM), (BATCH, seq_len, KV_HEADS, DIM),
              (BATCH, seq_len, KV_HEADS, DIM), (BATCH, seq_len, HEADS, DIM)]
    return [torch.randn(s, generator=g) for s in shapes]


def rope_angles(seq_len: int):
    """Rotate-half RoPE cos/sin [S, D] (theta 1e4)."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, DIM, 2).double() / DIM)
    angles = torch.arange(seq_len).double()[:, None] * inv_freq[None]
    angles = torch.cat([angles, angles], -1)
    return angles.cos().float(), angles.sin().float()


def rope_reference(x, cos, sin):
    """x [B, S, H, D] rotated with cos/sin [S, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[None, :, None] + rotated * sin[None, :, None]


def contiguous_shard(x, rank, world, dim=1):
    return x.chunk(world, dim=dim)[rank]


def relative_error(got, expected) -> float:
    return ((got.double() - expected.double()).norm() / expected.double().norm()).item()


class CausalSDPA(torch.nn.Module):
    """Ulysses' local attention in the tests: causal SDPA over [B, S, h, D] (or [S, B, h, D])
    with GQA; the scale comes from the call or SCALE. No scale attribute: MTraining must be told."""

    def __init__(self, batch_dim_idx: int):
        super().__init__()
        self.batch_dim_idx = batch_dim_idx

    def forward(self, q, k, v, is_causal=True, scale=None, softmax_scale=None, **_):
        assert is_causal
        if self.batch_dim_idx == 1:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        scale = scale if scale is not None else softmax_scale if softmax_scale is not None else SCALE
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2)
        return out.transpose(0, 1) if self.batch_dim_idx == 1 else out


class ScaledCausalSDPA(CausalSDPA):
    """The same with its scale as an attribute (what a model's attention module usually has)."""
    softmax_scale = SCALE


# call forms: (batch_dim_idx, local attention class, rotary table or None, call keywords)
FORMS = {
    "bshd_attribute_scale": (0, ScaledCausalSDPA, None, {}),
    "bshd_rotary": (0, ScaledCausalSDPA, "global", {}),
    "bshd_kwargs": (0, CausalSDPA, None, dict(is_causal=True, scale=0.25)),
    "sbhd_rotary_kwargs": (1, CausalSDPA, "global", dict(is_causal=True, softmax_scale=0.2)),
    "sbhd_attribute_scale": (1, ScaledCausalSDPA, None, {}),
}


def rotary_table(form_batch_dim: int, seq_len: int):
    """Ulysses' layout: permute(1, 0, 2, 3) broadcasts against q: [S, 1, 1, D] for batch-first
    q, [1, S, 1, D] for sequence-first q."""
    cos, sin = rope_angles(seq_len)
    if form_batch_dim == 0:
        return cos[:, None, None], sin[:, None, None]
    return cos[None, :, None], sin[None, :, None]


def run_form(attention, shards, dout, batch_dim_idx, table, kwargs):
    """Output and q/k/v gradients of one call; shards/dout batch-first, converted to the form."""
    to_form = (lambda t: t.transpose(0, 1).contiguous()) if batch_dim_idx == 1 else (lambda t: t)
    leaves = [to_form(t).requires_grad_() for t in shards]
    args = (batch_dim_idx,) if table is None else (batch_dim_idx, table)
    out = attention(*leaves, *args, **kwargs)
    (out * to_form(dout)).sum().backward()
    back = (lambda t: t.transpose(0, 1)) if batch_dim_idx == 1 else (lambda t: t)
    return [back(t.detach()) for t in (out, *[leaf.grad for leaf in leaves])]


def _errors(calls) -> dict:
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except (LayoutError, ValueError, TypeError) as error:
            errors[name] = f"{type(error).__name__}: {error}"
    return errors


def _ulysses_worker(rank, world):
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention as UlyssesAttention

    deepspeed.init_distributed(dist_backend="gloo")
    seq_len = SEQ[world]
    config = full_config(seq_len)
    q, k, v, dout = global_inputs(seq_len)
    striped = StripedLayout(world, BLOCK)
    local = seq_len // world
    contiguous_pos = torch.arange(rank * local, (rank + 1) * local)
    striped_pos = striped.positions(seq_len, rank)
    results = {}
    for name, (batch_dim_idx, local_cls, rotary, kwargs) in FORMS.items():
        group = dist.group.WORLD
        table = rotary_table(batch_dim_idx, seq_len) if rotary else None
        gather_idx = 1 if batch_dim_idx == 0 else 0
        ulysses = UlyssesAttention(local_cls(batch_dim_idx), group, 2, gather_idx)
        shards = [contiguous_shard(t, rank, world) for t in (q, k, v)]
        results[name, "ulysses"] = run_form(ulysses, shards, contiguous_shard(dout, rank, world),
                                            batch_dim_idx, table, kwargs)
        for layout in ("contiguous", "striped"):
            mtraining = DistributedAttention(local_cls(batch_dim_idx), group, 2, gather_idx,
                                             num_kv_heads=KV_HEADS, num_heads=HEADS, input_layout=layout,
                                             sparse_config=config)
            if layout == "contiguous":
                shards, grad, positions = [contiguous_shard(t, rank, world) for t in (q, k, v)], \
                    contiguous_shard(dout, rank, world), contiguous_pos
            else:
                shards, grad, positions = [striped.shard(t, rank) for t in (q, k, v)], \
                    striped.shard(dout, rank), striped_pos
            call_kwargs = dict(kwargs)
            if name.endswith("kwargs"):  # position_ids too (Ulysses hands it to its local attention)
                call_kwargs["position_ids"] = positions[None].expand(BATCH, -1)
            results[name, layout] = run_form(mtraining, shards, grad, batch_dim_idx, table, call_kwargs)
    results["dense"] = _dense_forms(rank, world, seq_len, config)
    # layout errors: the declared layout is verified against position_ids
    shards = [contiguous_shard(t, rank, world) for t in (q, k, v)]
    contiguous_layer = DistributedAttention(ScaledCausalSDPA(0), dist.group.WORLD, sparse_config=config)
    striped_layer = DistributedAttention(ScaledCausalSDPA(0), dist.group.WORLD, input_layout="striped",
                                         sparse_config=config)
    shuffled = contiguous_pos.flip(0)
    results["errors"] = _errors({
        "striped_ids_to_contiguous": lambda: contiguous_layer(*shards, 0, position_ids=striped_pos),
        "contiguous_ids_to_striped": lambda: striped_layer(*shards, 0, position_ids=contiguous_pos[None]),
        "neither": lambda: contiguous_layer(*shards, 0, position_ids=shuffled),
        "short_sequence": lambda: contiguous_layer(*(t[:, :BLOCK // 2] for t in shards), 0),
    })
    return results


def _dense_forms(rank, world, seq_len, config):
    """The forms Ulysses has no counterpart for: Megatron's core-attention call with a causal
    mask, a local (per-rank rows) rotary table, the known-function scale; against float64 dense."""
    q, k, v, dout = global_inputs(seq_len, seed=1)
    striped = StripedLayout(world, BLOCK)
    cos, sin = rope_angles(seq_len)
    out = {}
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)[None, None]  # True = masked
    for layout, shard in (("contiguous", lambda t: contiguous_shard(t, rank, world)),
                          ("striped", lambda t: striped.shard(t, rank))):
        attention = DistributedAttention(ScaledCausalSDPA(1), None, input_layout=layout, sparse_config=config)
        sbhd = [shard(t).transpose(0, 1).contiguous() for t in (q, k, v)]
        out["mask", layout] = attention(*sbhd, mask).transpose(0, 1)
        # rows of this rank's tokens, in Ulysses' batch-first layout [S/W, 1, 1, D]
        local_table = (shard(cos[None])[0][:, None, None], shard(sin[None])[0][:, None, None])
        sdpa = DistributedAttention(functools.partial(F.scaled_dot_product_attention, is_causal=True), None,
                                    input_layout=layout, sparse_config=config)
        out["local_rotary_sdpa", layout] = run_form(sdpa, [shard(t) for t in (q, k, v)], shard(dout), 0,
                                                    local_table, {})
    return out


def unshard(parts: list, layout: str, world: int):
    if layout == "striped":
        return StripedLayout(world, BLOCK).unshard(parts)
    return torch.cat(parts, dim=1)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"W{w}")
def ulysses_results(request, cpu_op):  # the op is built before the ranks start
    world = request.param
    return world, run_on_ranks(_ulysses_worker, world, timeout=TIMEOUT_S)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("layout", ["contiguous", "striped"])
def test_equals_deepspeed_ulysses(ulysses_results, form, layout):
    """Outputs and dq/dk/dv equal Ulysses' (norm-relative 1e-5) in every call form and layout."""
    world, results = ulysses_results
    names = ("out", "dq", "dk", "dv")
    for i, name in enumerate(names):
        expected = torch.cat([r[form, "ulysses"][i] for r in results], dim=1)
        got = unshard([r[form, layout][i] for r in results], layout, world)
        assert got.shape == expected.shape
        error = relative_error(got, expected)
        assert error < REL_TOL, f"{form}/{layout} W={world}: {name} relative error {error:.2e}"


def test_ulysses_agrees_with_dense(ulysses_results):
    """The reference itself: Ulysses' output in the kwargs form is float64 dense causal attention."""
    world, results = ulysses_results
    q, k, v, _ = global_inputs(SEQ[world])
    causal = torch.ones(SEQ[world], SEQ[world], dtype=torch.bool).tril()[None, None]
    expected = dense_attention(q, k, v, causal.expand(BATCH, HEADS, -1, -1), 0.25)
    got = torch.cat([r["bshd_kwargs", "ulysses"][0] for r in results], dim=1)
    torch.testing.assert_close(got.double(), expected, **DENSE_TOL)


def test_megatron_mask_form_and_local_rotary_equal_dense(ulysses_results):
    world, results = ulysses_results
    seq_len = SEQ[world]
    q, k, v, dout = global_inputs(seq_len, seed=1)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()[None, None].expand(BATCH, HEADS, -1, -1)
    plain = dense_attention(q, k, v, causal, SCALE)
    cos, sin = rope_angles(seq_len)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    roped = dense_attention(rope_reference(q64, cos, sin), rope_reference(k64, cos, sin), v64, causal,
                            1 / math.sqrt(DIM))
    roped.backward(dout.double())
    for layout in ("contiguous", "striped"):
        got = unshard([r["dense"]["mask", layout] for r in results], layout, world)
        torch.testing.assert_close(got.double(), plain, **DENSE_TOL)
        for i, expected in enumerate((roped.detach(), q64.grad, k64.grad, v64.grad)):
            got = unshard([r["dense"]["local_rotary_sdpa", layout][i] for r in results], layout, world)
            torch.testing.assert_close(got.double(), expected, **DENSE_TOL)


def test_declared_layout_is_verified(ulysses_results):
    world, results = ulysses_results
    for rank, result in enumerate(results):
        errors = result["errors"]
        assert errors["striped_ids_to_contiguous"].startswith("LayoutError") and \
            "pass input_layout='striped'" in errors["striped_ids_to_contiguous"]
        message = errors["contiguous_ids_to_striped"]
        assert "contiguous shard" in message and "drop input_layout=" in message and \
            f"StripedLayout({world}, {BLOCK})" in message
        assert "are neither this rank's contiguous positions" in errors["neither"]
        assert f"multiple of {world * BLOCK}" in errors["short_sequence"]


# ----------------------------------------------------------------------------- one process
S1 = 128


def single_inputs():
    q, k, v, _ = global_inputs(S1)
    return q, k, v


def dense_reference(q, k, v, scale, cos=None, sin=None):
    if cos is not None:
        q, k = rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    causal = torch.ones(S1, S1, dtype=torch.bool).tril()[None, None].expand(BATCH, HEADS, -1, -1)
    return dense_attention(q, k, v, causal, scale)


def layer(local_attention, **kwargs):
    return DistributedAttention(local_attention, None, sparse_config=full_config(S1), **kwargs)


def flash_attn_func(q, k, v, causal=False, softmax_scale=None):
    """Stands for flash_attn's function of this name: recognised by module and name."""


flash_attn_func.__module__ = "flash_attn.flash_attn_interface"


class NoScale(torch.nn.Module):
    """A local attention that applies some scale of its own and does not say which."""


class NoneScale(torch.nn.Module):
    softmax_scale = None  # flash-attn / Megatron convention: 1/sqrt(D)


@pytest.mark.usefixtures("built_ops")  # calls the op in this process
@pytest.mark.parametrize("local_attention, kwargs, expected_scale", [
    (F.scaled_dot_product_attention, dict(is_causal=True), 1 / math.sqrt(DIM)),
    (F.scaled_dot_product_attention, dict(is_causal=True, scale=0.2), 0.2),
    (functools.partial(F.scaled_dot_product_attention, is_causal=True, scale=0.15), {}, 0.15),
    (flash_attn_func, dict(causal=True), 1 / math.sqrt(DIM)),
    (flash_attn_func, dict(causal=True, softmax_scale=0.35), 0.35),
    (NoneScale(), {}, 1 / math.sqrt(DIM)),
    (ScaledCausalSDPA(0), {}, SCALE),
    (ScaledCausalSDPA(0), dict(scale=0.1), 0.1),  # the call wins over the attribute
    (NoScale(), dict(softmax_scale=0.4), 0.4),
])
def test_softmax_scale_sources(local_attention, kwargs, expected_scale):
    q, k, v = single_inputs()
    out = layer(local_attention)(q, k, v, 0, **kwargs)
    torch.testing.assert_close(out.double(), dense_reference(q, k, v, expected_scale), **DENSE_TOL)


@pytest.mark.usefixtures("built_ops")  # calls the op in this process
def test_one_process_rotary_and_sequence_first_equal_dense():
    q, k, v = single_inputs()
    cos, sin = rope_angles(S1)
    attention = layer(ScaledCausalSDPA(1), num_heads=HEADS, num_kv_heads=KV_HEADS)
    out = attention(*(t.transpose(0, 1) for t in (q, k, v)), 1, (cos[None, :, None], sin[None, :, None]))
    torch.testing.assert_close(out.transpose(0, 1).double(), dense_reference(q, k, v, SCALE, cos, sin), **DENSE_TOL)


@pytest.mark.parametrize("local_attention, call, message", [
    (NoScale(), lambda a, q, k, v: a(q, k, v, 0),
     r"cannot tell the softmax scale of local_attention NoScale: .*pass scale= to the call"),
    (F.scaled_dot_product_attention, lambda a, q, k, v: a(q, k, v, 0, scale=0.2),
     r"scaled_dot_product_attention, which is not causal unless is_causal=True; pass is_causal=True"),
    (flash_attn_func, lambda a, q, k, v: a(q, k, v, 0),
     r"flash_attn.flash_attn_func, which is not causal unless causal=True"),
    (ScaledCausalSDPA(0), lambda a, q, k, v: a(q, k, v, 0, is_causal=False), r"is_causal=False: .*causal only"),
    (ScaledCausalSDPA(0), lambda a, q, k, v: a(q, k, v, 0, scale=0.1, softmax_scale=0.2),
     r"scale=0.1 and softmax_scale=0.2 differ"),
    (ScaledCausalSDPA(0), lambda a, q, k, v: a(q, k, v, 0, dropout_p=0.1), r"dropout is not supported"),
    (ScaledCausalSDPA(0), lambda a, q, k, v: a(q, k, v, 0, window_size=(8, 0)),
     r"unexpected keyword argument\(s\) \['window_size'\]"),
    (ScaledCausalSDPA(0), lambda a, q, k, v: a(q, k, v, 0, None, "extra"), r"1 extra positional argument"),
    (ScaledCausalSDPA(0), lambda a, q, k, v: a(q, k, v, 2), r"batch_dim_idx=2 must be 0"),
    # HF / the old layout of this layer: [1, S, 1, D] with batch-first q is not Ulysses' layout
    (ScaledCausalSDPA(0), lambda a, q, k, v: a(q, k, v, 0, (torch.ones(1, S1, 1, DIM),) * 2),
     r"rotary_pos_emb cos has shape \(1, 128, 1, 16\); Ulysses' layout for batch-first q is \[S, 1, 1, D_rot\]"),
    (ScaledCausalSDPA(0), lambda a, q, k, v: a(q, k, v, 0, position_ids=torch.arange(S1).flip(0)),
     r"are neither this rank's contiguous positions 0..127"),
    (ScaledCausalSDPA(0), lambda a, q, k, v: a(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0),
     r"query has shape \(2, 8, 128, 16\) but the layer was built with num_heads=8.*\.transpose\(1, 2\)"),
    (ScaledCausalSDPA(0), lambda a, q, k, v: a(q, v[..., :8], v, 0), r"do not match"),
    # Megatron's form with a mask that is not the causal one (True = masked: here the future is visible)
    (ScaledCausalSDPA(1), lambda a, q, k, v: a(*(t.transpose(0, 1) for t in (q, k, v)),
                                               torch.ones(S1, S1, dtype=torch.bool).tril(-1)[None, None]),
     r"the attention mask is not the causal mask"),
    (ScaledCausalSDPA(0), lambda a, q, k, v: a(q[:, :100], k[:, :100], v[:, :100], 0), r"multiple of 64"),
])
def test_call_errors(local_attention, call, message):
    q, k, v = single_inputs()
    attention = layer(local_attention, num_heads=HEADS, num_kv_heads=KV_HEADS)
    with pytest.raises((ValueError, TypeError), match=message):
        call(attention, q, k, v)


def test_head_count_check_catches_a_bhsd_tensor():
    """[B, H, S, D] with H = S/W would pass a plain shape check; num_heads catches it."""
    square = torch.randn(BATCH, S1, S1, DIM)  # heads dim == sequence
    with pytest.raises(ValueError, match=r"built with num_heads=8"):
        layer(ScaledCausalSDPA(0), num_heads=HEADS)(square, square, square, 0)


@pytest.mark.parametrize("kwargs, local_attention, message", [
    (dict(scatter_idx=1), None, r"pass scatter_idx=2"),
    (dict(gather_idx=2), None, r"gather_idx=2: the sequence dimension must be 0 or 1"),
    (dict(input_layout="zigzag"), None, r"input_layout='zigzag' is not a layout; use 'contiguous'"),
    (dict(num_heads=6, num_kv_heads=4), None, r"num_heads=6 is not a multiple of num_kv_heads=4"),
    (dict(num_kv_heads=0), None, r"num_kv_heads=0 must be a positive int"),
    ({}, type("NonCausal", (torch.nn.Module,), {"causal": False})(), r"local_attention.causal is False"),
    ({}, functools.partial(F.scaled_dot_product_attention, is_causal=False), r"is_causal is False"),
    ({}, functools.partial(F.scaled_dot_product_attention, dropout_p=0.1), r"dropout_p=0.1"),
])
def test_constructor_errors(kwargs, local_attention, message):
    with pytest.raises(ValueError, match=message):
        DistributedAttention(local_attention or ScaledCausalSDPA(0), None, **kwargs)
