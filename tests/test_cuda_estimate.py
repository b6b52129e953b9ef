"""GPU tests of the fused vertical-slash estimator (ds_mtraining.estimator.fused) against the torch
rule (ds_mtraining.estimator.rule) and float64 masses. Skipped without a CUDA device.

* masses and row statistics vs float64 (relative 1e-3), over shapes: S not a multiple of the
  64-key tile, S < last_q, last_q > 64 (several row chunks), GQA 1/4/8, D 64/128, bf16/fp16;
* striped shards (world 2, 3, emulated on one device) give the single-device masses;
* the top-p selection equals torch's exactly on exact-sum inputs (ties, caps, zeros, rows of
  several chunks), the two-list selection equals two single ones, and the finalize step equals
  SparseIndex.from_vertical_slash;
* the index equals the torch estimator's on planted inputs (masses well separated at the
  threshold, asserted first); on noise at most 1% of selected entries differ, all near the
  threshold;
* no host synchronisation (torch.cuda.set_sync_debug_mode("error")); bitwise reproducible.
"""
from __future__ import annotations

import math

import pytest
import torch

from ds_mtraining import SparseConfig, synthetic
from ds_mtraining.estimator.rule import (column_and_diagonal_mass, estimate_vertical_slash, select_top_p,
                                   top_p_count)
from ds_mtraining.index import PAD, SparseIndex
from helpers import differing_entries

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    from ds_mtraining.estimator import fused as ec

MASS_TOLERANCE = 1e-3


def random_qk(batch, seq, heads, kv_heads, dim, dtype, seed=0, sharp=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, dim, generator=g) * sharp
    k = torch.randn(batch, seq, kv_heads, dim, generator=g) * sharp
    return q.to("cuda", dtype), k.to("cuda", dtype)


def reference_masses(q, k, lq, scale):
    """Float64 (row_max, row_sum, columns, diagonals) of the rule on the given (rounded) q, k."""
    b, s, h, d = q.shape
    hkv = k.shape[2]
    q_last = q[:, s - lq:].double().view(b, lq, hkv, h // hkv, d)
    logits = torch.einsum("bqkgd,bskd->bkgqs", q_last, k.double()).reshape(b, h, lq, s) * scale
    pos = torch.arange(s, device=q.device)
    logits = logits.masked_fill(pos[s - lq:, None] < pos[None, :], float("-inf"))
    row_max = logits.amax(-1)
    row_sum = torch.exp(logits - row_max[..., None]).sum(-1)
    columns, diagonals = column_and_diagonal_mass(torch.softmax(logits, -1))
    return row_max, row_sum, columns, diagonals


def relative_error(actual, expected):
    assert torch.isfinite(actual).all(), "kernel output holds NaN or inf"
    return float((actual.double() - expected).norm() / expected.norm().clamp_min(1e-300))


def fused_masses(q, k, lq, scale, world=1, rank=0, block=64):
    s = q.shape[1]
    q_last = q[:, s - lq:]
    stats = ec.row_stats(q_last, k, s - lq, s, scale, world, rank, block)
    return (*stats, *ec.masses(q_last, k, *stats, s - lq, s, scale, world, rank, block))


SHAPES = [
    # batch, seq, heads, kv_heads, dim, dtype, last_q
    (1, 1000, 4, 4, 64, torch.bfloat16, 64),     # GQA 1, S not a multiple of 64
    (2, 777, 8, 2, 128, torch.float16, 64),      # GQA 4, fp16, batch 2
    (1, 2048, 8, 1, 128, torch.bfloat16, 64),    # GQA 8
    (1, 40, 4, 2, 64, torch.bfloat16, 64),       # S < last_q
    (1, 1500, 4, 2, 128, torch.bfloat16, 150),   # three row chunks, the last partial
    (1, 4100, 16, 2, 64, torch.float16, 256),    # four row chunks, GQA 8
    (1, 1200, 4, 2, 256, torch.bfloat16, 256),   # head_dim 256 (Gemma's), four row chunks
    (1, 900, 4, 1, 256, torch.float16, 64),      # head_dim 256, fp16
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}-S{s[1]}-H{s[2]}/{s[3]}-D{s[4]}-{str(s[5])[6:]}-L{s[6]}")
def test_masses_match_float64(shape):
    batch, seq, heads, kv_heads, dim, dtype, last_q = shape
    q, k = random_qk(batch, seq, heads, kv_heads, dim, dtype, seed=seq, sharp=1.5)
    lq = min(last_q, seq)
    scale = 1.0 / math.sqrt(dim)
    got = fused_masses(q, k, lq, scale)
    expected = reference_masses(q, k, lq, scale)
    names = ("row_max", "row_sum", "columns", "diagonals")
    for name, actual, ref in zip(names, got, expected):
        assert actual.shape == ref.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(ref.shape)}"
        error = relative_error(actual, ref)
        assert error <= MASS_TOLERANCE, f"{name}: relative error {error:.3g} > {MASS_TOLERANCE}"
    # entrywise on the large entries too (a wrong diagonal would hide in a norm)
    for name, actual, ref in zip(names[2:], got[2:], expected[2:]):
        big = ref > 1e-3 * ref.amax(-1, keepdim=True)
        worst = float(((actual.double() - ref).abs() / ref.clamp_min(1e-300))[big].max())
        assert worst <= 1e-2, f"{name}: worst entrywise relative error {worst:.3g} on the large entries"
    # rows sum to one: columns and diagonals both total 1 per head
    torch.testing.assert_close(got[2].double().sum(-1), torch.ones_like(expected[2].sum(-1)), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[3].double().sum(-1), torch.ones_like(expected[3].sum(-1)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("world,block,last_q", [(2, 64, 64), (3, 128, 64), (2, 128, 150), (4, 64, 100)])
def test_striped_shards_give_the_global_masses(world, block, last_q):
    """Per-rank passes on striped keys, the row statistics merged and the diagonals summed as the
    all-reduces would: the single-device masses (columns land on their global positions)."""
    seq = world * block * 5
    q, k = random_qk(1, seq, 4, 2, 128, torch.bfloat16, seed=world, sharp=1.5)
    lq, scale = min(last_q, seq), 1.0 / math.sqrt(128)
    q_last = q[:, seq - lq:]
    positions = []
    stats = []
    for rank in range(world):
        local = torch.arange(seq // world, device="cuda")
        pos = (local // block * world + rank) * block + local % block
        positions.append(pos)
        stats.append(ec.row_stats(q_last, k[:, pos], seq - lq, seq, scale, world, rank, block))
    row_max = torch.stack([m for m, _ in stats]).amax(0)
    row_sum = sum(torch.where(torch.isfinite(m), s * torch.exp(m - row_max), 0.0) for m, s in stats)
    columns = torch.zeros(1, 4, seq, device="cuda")
    diagonals = torch.zeros(1, 4, seq, device="cuda")
    for rank, pos in enumerate(positions):
        c, d = ec.masses(q_last, k[:, pos], row_max, row_sum, seq - lq, seq, scale, world, rank, block)
        columns[..., pos] = c
        diagonals += d
    _, _, ref_c, ref_d = reference_masses(q, k, lq, scale)
    assert relative_error(columns, ref_c) <= MASS_TOLERANCE, "striped column masses"
    assert relative_error(diagonals, ref_d) <= MASS_TOLERANCE, "striped diagonal masses"


# ---------------------------------------------------------------------------- selection
def torch_selection(mass, p, cap):
    """Torch's selected positions per row as sorted lists."""
    chosen = select_top_p(mass, p, cap)
    return [sorted(v for v in row if v >= 0) for row in chosen.view(-1, chosen.shape[-1]).tolist()]


def fused_selection(mass, p, cap):
    indices, count = ec.select_top_p_padded(mass, p, cap)
    n = mass.shape[-1]
    assert indices.shape[-1] == min(cap, n), "the list width is min(cap, n)"
    rows, counts = indices.view(-1, indices.shape[-1]).tolist(), count.flatten().tolist()
    for row, c in zip(rows, counts):
        assert 1 <= c <= min(cap, n), f"count {c} outside [1, {min(cap, n)}]"
        assert all(v == PAD for v in row[c:]), "entries past the count must be PAD"
        assert row[:c] == sorted(set(row[:c])) and all(0 <= v < n for v in row[:c]), "not ascending/unique/in range"
    return [row[:c] for row, c in zip(rows, counts)]


@pytest.mark.parametrize("n", [1, 7, 1000, 4097, 300_001])
def test_select_equals_torch_on_exact_sums(n):
    """Masses on a 2^-20 grid with at most ~1e5 quanta per row, so that torch's fp32 cumsums and
    the kernel's fixed-point sums are both exact and no sum lies within the rule's 1e-6 slack of
    the target: ties by position, caps, zeros, p = 1 and a dominant entry select exactly torch's
    set."""
    g = torch.Generator().manual_seed(n)
    sparse = (torch.rand(n, generator=g) < min(1.0, 20_000 / n)).float()
    rows = [torch.randint(0, 8, (n,), generator=g).float() * sparse,  # many ties
            torch.zeros(n),                                              # all zero: the first entry
            torch.randint(0, 2, (n,), generator=g).float() * sparse,    # two values
            torch.ones(n)]                                               # all tied ...
    rows[3][n // 2] = 5000.0                                             # ... but one
    mass = (torch.stack(rows) * 2.0 ** -20).cuda()
    for p in (0.1, 0.5, 0.9, 1.0):
        for cap in (1, 5, 4096):
            assert fused_selection(mass, p, cap) == torch_selection(mass, p, cap), f"n={n} p={p} cap={cap}"


def test_select_pair_equals_two_selections():
    """Two lists of different lengths, p and cap in the same launches (the rows of the shorter one
    have fewer chunks): each equals its own selection and torch's, across chunk boundaries."""
    g = torch.Generator().manual_seed(11)
    a = (torch.randint(0, 8, (3, 40_000), generator=g).float() * 2.0 ** -20).cuda()
    b = (torch.randint(0, 3, (2, 2, 9000), generator=g).float() * 2.0 ** -20).cuda()
    b[1, 0, 8500] = 2000 * 2.0 ** -20  # one dominant entry in the last chunk
    for (pa, ca), (pb, cb) in (((0.5, 4096), (0.9, 100)), ((1.0, 1), (0.3, 9000)), ((0.1, 50_000), (1.0, 5))):
        (ia, na), (ib, nb) = ec.select_top_p_padded_pair(a, pa, ca, b, pb, cb)
        for mass, p, cap, got in ((a, pa, ca, (ia, na)), (b, pb, cb, (ib, nb))):
            single = ec.select_top_p_padded(mass, p, cap)
            assert torch.equal(got[0], single[0]) and torch.equal(got[1], single[1]), f"pair != single, p={p}"
            assert fused_selection(mass, p, cap) == torch_selection(mass, p, cap), f"p={p} cap={cap}"


def differing_near_threshold(mass64, p, cap, mine, theirs):
    """Entries in exactly one of two selections, and whether each lies near the top-p threshold:
    its float64 mass within 1e-3 of the threshold entry's, or the mass ahead of it within 1e-3 of
    the target."""
    values, order = mass64.sort(descending=True, stable=True)
    count = int(top_p_count(values[None], p, cap)[0])
    threshold = float(values[count - 1])
    ahead = values.cumsum(0) - values
    rank_of = torch.empty_like(order)
    rank_of[order] = torch.arange(order.numel(), device=order.device)
    target = p * float(values.sum())
    differing = sorted(set(mine) ^ set(theirs))
    far = []
    for e in differing:
        near_mass = abs(float(mass64[e]) - threshold) <= 1e-3 * threshold
        near_sum = abs(float(ahead[rank_of[e]]) - target) <= 1e-3 * float(values.sum())
        capped = count == min(cap, mass64.numel())
        if not (near_mass or (near_sum and not capped)):
            far.append(e)
    return differing, far


def test_select_on_float_masses_differs_only_at_the_threshold():
    g = torch.Generator().manual_seed(3)
    mass = torch.exp(torch.randn(6, 50_000, generator=g) * 2).double()
    mass /= mass.sum(-1, keepdim=True)
    for p, cap in ((0.5, 100_000), (0.9, 4096), (0.99, 100_000)):
        mine = fused_selection(mass.float().cuda(), p, cap)
        theirs = torch_selection(mass.float(), p, cap)
        for row in range(mass.shape[0]):
            differing, far = differing_near_threshold(mass[row], p, cap, mine[row], theirs[row])
            assert len(differing) <= max(1, len(theirs[row]) // 100), f"p={p} row {row}: {len(differing)} differ"
            assert not far, f"p={p} row {row}: entries far from the threshold differ: {far[:10]}"


def test_finalize_equals_from_vertical_slash():
    g = torch.Generator().manual_seed(0)
    for seq, block, local_blocks, sinks in ((1000, 64, 1, 4), (4096, 128, 2, 0), (70, 64, 3, 100)):
        b, h, a, c = 2, 3, 9, 30
        tokens = torch.randint(0, seq, (b, h, a), generator=g)
        multiples = torch.arange(a) * block  # multiples of the block mark one block diagonal
        tokens[0, 0] = torch.where(multiples < seq, multiples, -1)
        tokens[1, 2, 5:] = -1
        cols = torch.randint(0, seq, (b, h, c), generator=g)
        cols[0, 1] = seq - 1 - torch.arange(c)  # columns in the last blocks: dropped when covered
        cols = torch.where(torch.rand(b, h, c, generator=g) < 0.2, -1, cols)
        col_count = torch.zeros(b, h, dtype=torch.int32)
        col_sorted = torch.full((b, h, c), PAD, dtype=torch.int32)
        for i in range(b):
            for j in range(h):
                values = sorted(set(v for v in cols[i, j].tolist() if v >= 0))
                col_sorted[i, j, :len(values)] = torch.tensor(values, dtype=torch.int32)
                col_count[i, j] = len(values)
        token_count = torch.full((b, h), a, dtype=torch.int32)
        config = SparseConfig(block_size=block, local_blocks=local_blocks, sink_tokens=sinks)
        fused = ec.build_index(tokens.int().cuda(), token_count.cuda(), col_sorted.cuda(), col_count.cuda(),
                               seq, config)
        sink = torch.arange(min(sinks, seq)).expand(b, h, -1)
        expected = SparseIndex.from_vertical_slash(torch.cat([cols, sink], -1), tokens, seq, block, local_blocks)
        slash, vertical = ec.trimmed(fused)
        assert torch.equal(slash.cpu(), expected.slash), f"slash, seq={seq} block={block}"
        assert torch.equal(vertical.cpu(), expected.vertical), f"vertical, seq={seq} block={block}"
        assert torch.equal(fused.slash_count.cpu(), expected.slash_count)
        assert torch.equal(fused.vertical_count.cpu(), expected.vertical_count)


# ---------------------------------------------------------------------------- the index
PLANTED = [
    # seq, heads, kv_heads, dim, dtype, block, slash offsets per kv head, columns per kv head, sharpness
    (2048, 4, 2, 64, torch.bfloat16, 64, (100, 450), ((7, 40, 1500), (333, 900, 1000)), 2.5),
    (3000, 8, 1, 128, torch.float16, 128, (260,), ((5, 900, 2000),), 2.5),
    # the slash logit grows as sharp^2 sqrt(D): at 256 a lower sharpness keeps it separable
    (2500, 4, 2, 256, torch.bfloat16, 128, (70, 300), ((3, 1000, 1800), (3, 1000, 1800)), 1.5),
    (1500, 8, 2, 128, torch.bfloat16, 64, (64, 129), ((1, 2, 3), (300, 500, 800)), 2.5),
]
CANDIDATE_P = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.02)


def planted_case(seq, heads, kv_heads, dim, dtype, offsets, columns, sharp=2.5, column_logit=(-2.0, -3.0, -4.0)):
    """synthetic.planted_qk slashes, plus columns whose logits sit 2, 3 and 4 below the slash's (a
    constant last query coordinate times a per-column key coordinate): distinct column masses."""
    q, k = synthetic.planted_qk(seq, heads, kv_heads, dim, offsets=offsets, columns=[()] * kv_heads,
                                sharp=sharp, column_gain=0.0)
    scale = 1.0 / math.sqrt(dim)
    slash_logit = sharp ** 2 * (dim // 2 - 4) * scale
    q[..., -1] = 4.0
    for kv, cols in enumerate(columns):
        for c, logit in zip(cols, column_logit):
            k[:, c, kv, -1] = (slash_logit + logit) / (4.0 * scale)
    return q.to("cuda", dtype), k.to("cuda", dtype)


def separated(mass, p, cap, gap=2e-2, margin=1e-3):
    """Whether every head's top-p selection is well conditioned: the last kept entry exceeds the
    next by a relative ``gap`` and the mass ahead of each crosses ``p * total`` by ``margin``."""
    values = mass.sort(-1, descending=True).values.double()
    count = top_p_count(values, p, cap)
    total = values.sum(-1)
    ahead = values.cumsum(-1) - values
    last_i = count[..., None] - 1
    next_i = (last_i + 1).clamp(max=values.shape[-1] - 1)
    last, after = values.gather(-1, last_i)[..., 0], values.gather(-1, next_i)[..., 0]
    ahead_last, ahead_next = ahead.gather(-1, last_i)[..., 0], ahead.gather(-1, next_i)[..., 0]
    target = p * total
    ok = ((last - after) >= gap * last) & ((target - ahead_last) >= margin * total) & (
        (ahead_next - target) >= margin * total)
    return bool(ok.all())


@pytest.mark.parametrize("case", PLANTED, ids=lambda c: f"S{c[0]}-H{c[1]}/{c[2]}-D{c[3]}-{str(c[4])[6:]}-b{c[5]}")
def test_index_equals_torch_on_planted_inputs(case):
    """With p_vertical and p_slash the largest candidates at which every head's float64 masses are
    well separated at the threshold, the fused index equals the torch estimator's exactly."""
    seq, heads, kv_heads, dim, dtype, block, offsets, columns, sharp = case
    q, k = planted_case(seq, heads, kv_heads, dim, dtype, offsets, columns, sharp=sharp)
    lq = min(SparseConfig().last_q, seq)
    _, _, cols64, diags64 = reference_masses(q, k, lq, 1.0 / math.sqrt(dim))
    p_vertical = next((p for p in CANDIDATE_P if separated(cols64, p, 4096)), None)
    p_slash = next((p for p in CANDIDATE_P if separated(diags64, p, 4096)), None)
    assert p_vertical is not None and p_slash is not None, "test input: no well-separated p (not a kernel error)"
    config = SparseConfig(block_size=block, p_vertical=p_vertical, p_slash=p_slash)
    fused = ec.estimate_vertical_slash_cuda(q, k, config)
    expected = estimate_vertical_slash(q, k, config)
    slash, vertical = ec.trimmed(fused)
    assert torch.equal(slash, expected.slash), f"slash lists differ from the torch rule (p_slash={p_slash})"
    assert torch.equal(vertical, expected.vertical), f"vertical lists differ (p_vertical={p_vertical})"
    assert torch.equal(fused.slash_count, expected.slash_count)
    assert torch.equal(fused.vertical_count, expected.vertical_count)


@pytest.mark.parametrize("shape", [(1, 4096, 8, 2, 128, torch.bfloat16), (2, 3000, 4, 4, 64, torch.float16),
                                   (1, 50, 8, 1, 64, torch.bfloat16)])
def test_index_on_noise_differs_at_most_one_percent(shape):
    batch, seq, heads, kv_heads, dim, dtype = shape
    q, k = random_qk(batch, seq, heads, kv_heads, dim, dtype, seed=seq, sharp=1.5)
    for config in (SparseConfig(block_size=64), SparseConfig(block_size=128, p_vertical=0.5, p_slash=0.8,
                                                             max_vertical=300, max_slash_diagonals=100)):
        differing, total = differing_entries(ec.estimate_vertical_slash_cuda(q, k, config),
                                           estimate_vertical_slash(q, k, config))
        assert differing <= max(2, total // 100), f"{differing} of {total} selected entries differ"


def test_no_host_synchronisation_and_reproducible():
    q, k = random_qk(1, 5000, 8, 2, 128, torch.bfloat16, sharp=1.5)
    config = SparseConfig(block_size=64)
    first = ec.estimate_vertical_slash_cuda(q, k, config)  # loads the op, warms the allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = ec.estimate_vertical_slash_cuda(q, k, config)
        stats = ec.row_stats(q[:, -64:], k, 5000 - 64, 5000, 0.1)
        masses = ec.masses(q[:, -64:], k, *stats, 5000 - 64, 5000, 0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for name in ("slash", "slash_count", "vertical", "vertical_count"):
        assert torch.equal(getattr(first, name), getattr(second, name)), f"{name} differs between runs"
    again = ec.masses(q[:, -64:], k, *ec.row_stats(q[:, -64:], k, 5000 - 64, 5000, 0.1), 5000 - 64, 5000, 0.1)
    assert all(torch.equal(a, b) for a, b in zip(masses, again)), "masses are not bitwise reproducible"


def test_index_is_usable_by_the_sparse_kernels():
    """The fixed-width lists (PAD tails) drive sparse attention like the torch estimator's lists."""
    from ds_mtraining.attention import sparse_attention
    q, k = random_qk(1, 2000, 4, 2, 64, torch.bfloat16, sharp=1.5)
    v = torch.randn_like(k)
    config = SparseConfig(block_size=64)
    fused = ec.estimate_vertical_slash_cuda(q, k, config)
    slash, vertical = ec.trimmed(fused)
    trimmed = SparseIndex(slash, vertical, fused.seq_len, fused.block_size)
    out = sparse_attention(q, k, v, fused)
    torch.testing.assert_close(out, sparse_attention(q, k, v, trimmed))  # bf16 tolerances


def test_rejects_what_it_cannot_take():
    q, k = random_qk(1, 512, 4, 2, 64, torch.bfloat16)  # S > 300: min(last_q, S) = 300 rows > 256
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        ec.estimate_vertical_slash_cuda(q.float(), k.float(), SparseConfig())
    with pytest.raises(ValueError, match="last_q=300"):
        ec.estimate_vertical_slash_cuda(q, k, SparseConfig(last_q=300))
    # last_q above the kernels' 256 rows but S below it: only S rows are scored, which it takes
    short_q, short_k = q[:, :200], k[:, :200]
    ec.estimate_vertical_slash_cuda(short_q, short_k, SparseConfig(last_q=300))


MANY_SHORT = tuple(int(n) for n in torch.randint(1, 90, (150,), generator=torch.Generator().manual_seed(0))) + (900,)


@pytest.mark.parametrize("lengths,last_q", [((1000, 24, 1, 700, 325), 64), ((2048,), 64), (MANY_SHORT, 64),
                                            ((1000, 24, 1, 700, 325, 130), 200)],
                         ids=["five documents", "one document", "151 documents", "last_q 200"])
def test_document_masses_match_float64(lengths, last_q):
    """fused.document_masses (passes A and B of every document in the same launches)
    against the torch document rule in float64 on the same rounded q, k: documents shorter than
    last_q and than a tile, of one token, and not multiples of 64; 151 documents; last_q over
    several 64-row chunks (documents of different chunk and split counts); two batch rows packed
    differently. The same masses, bit for bit, from only the read query rows (q_positions), and no
    autograd graph from a q that requires grad."""
    from ds_mtraining.documents import doc_start_from_cu_seqlens
    from ds_mtraining.estimator.rule import document_column_and_diagonal_mass, document_query_positions
    seq, scale = sum(lengths), 1.0 / math.sqrt(128)
    q, k = random_qk(2, seq, 8, 2, 128, torch.bfloat16, seed=seq, sharp=1.5)
    cu = [torch.tensor([0, *torch.tensor(order).cumsum(0).tolist()]) for order in (lengths, lengths[::-1])]
    doc_start = torch.cat([doc_start_from_cu_seqlens(c, seq) for c in cu]).cuda()
    got = ec.document_masses(q.requires_grad_(), k, doc_start, last_q, scale)
    assert not any(t.requires_grad for t in got), "the estimate builds no autograd graph from training's q"
    expected = document_column_and_diagonal_mass(q.detach().double(), k.double(), doc_start, last_q, scale)
    for name, actual, ref in zip(("columns", "diagonals"), got, expected):
        error = relative_error(actual, ref.double())
        assert error <= MASS_TOLERANCE, f"{name}: relative error {error:.3g} > {MASS_TOLERANCE}"
    positions = document_query_positions(doc_start, last_q)
    rows = ec.document_masses(q.detach()[:, positions], k, doc_start, last_q, scale, q_positions=positions)
    for name, a, b in zip(("columns", "diagonals"), rows, got):
        assert torch.equal(a, b), f"{name} from the read query rows differ"


def test_document_masses_reject_documents_outside_the_tensors():
    q, k = random_qk(1, 256, 4, 2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="does not lie in q"):
        ec._op().estimate_document_masses(q, k, [0, 200], [200, 100], [0, 0], [136, 192], [0.5, 0.5], 64, 0.125)


def test_document_index_on_gpu_matches_the_torch_rule_without_host_syncs():
    """The document-aware estimate on one GPU (estimator.estimate_index with doc_start:
    fused masses, selection and finalize): its index against the torch rule's on the same inputs
    (the 1% rule of the noise test), and a second call with the same doc_start (as the next layer
    of a step makes) under set_sync_debug_mode("error")."""
    from ds_mtraining.documents import doc_start_from_cu_seqlens
    from ds_mtraining.estimator import estimate_index
    lengths = (1000, 2, 24, 1, 700, 325)
    seq = sum(lengths)
    q, k = random_qk(2, seq, 8, 2, 128, torch.bfloat16, seed=seq, sharp=1.5)
    cu = [torch.tensor([0, *torch.tensor(order).cumsum(0).tolist()]) for order in (lengths, lengths[::-1])]
    doc_start = torch.cat([doc_start_from_cu_seqlens(c, seq) for c in cu]).cuda()
    config = SparseConfig(block_size=64, max_vertical=200, max_slash_diagonals=60)
    first = estimate_index(q, k, config, None, doc_start=doc_start)  # reads the documents once
    differing, total = differing_entries(first, estimate_vertical_slash(q, k, config, doc_start=doc_start))
    assert differing <= max(2, total // 100), f"{differing} of {total} selected entries differ"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = estimate_index(q, k, config, None, doc_start=doc_start)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name in ("slash", "slash_count", "vertical", "vertical_count"):
        assert torch.equal(getattr(first, name), getattr(second, name)), name


def test_merge_columns_is_the_sorted_union():
    """fused.merge_columns (one CTA per row, chunked scans) against the set union: lists
    longer than a scan chunk (256), overlapping and disjoint, empty selections, a batch row
    without extra columns, entries past the count ignored."""
    from helpers import TorchPasses
    g = torch.Generator().manual_seed(0)
    batch, heads, width, extra_width = 2, 3, 600, 700
    selected = torch.full((batch, heads, width), PAD, dtype=torch.int32)
    count = torch.zeros(batch, heads, dtype=torch.int32)
    for row in range(batch):
        for head, n in enumerate((0, 37, 600)[: heads]):
            chosen = torch.randperm(3000, generator=g)[:n].sort().values
            selected[row, head, :n] = chosen.int()
            selected[row, head, n:] = 7 if n < width else PAD  # past the count: never read
            count[row, head] = n
    extra = torch.full((batch, extra_width), PAD, dtype=torch.int32)
    extra[0] = torch.randperm(3000, generator=g)[:extra_width].sort().values.int()  # row 1: none
    merged, merged_count = ec.merge_columns(selected.cuda(), count.cuda(), extra.cuda())
    expected, expected_count = TorchPasses.merge_columns(selected, count, extra)
    assert torch.equal(merged.cpu(), expected) and torch.equal(merged_count.cpu(), expected_count)
