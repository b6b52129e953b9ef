"""The compact index against its dense meaning: causality, coverage, transposes, sizes."""
import pytest
import torch

from ds_mtraining.index import PAD, SparseIndex, Stripe
from ds_mtraining.reference import dense_mask, key_block_lists, query_block_lists, vertical_lists
from ds_mtraining.layout import StripedLayout


def random_index(seed, batch=2, heads=3, seq_len=700, block=64, nv=20, ns=6):
    g = torch.Generator().manual_seed(seed)
    vertical = torch.randint(0, seq_len, (batch, heads, nv), generator=g)
    slash = torch.randint(0, seq_len, (batch, heads, ns), generator=g)
    vertical[..., -3:] = -1  # padding entries
    slash[..., -1] = -1
    return SparseIndex.from_vertical_slash(vertical, slash, seq_len, block), vertical, slash


@pytest.mark.parametrize("seq_len,block", [(700, 64), (512, 128), (1024, 64)])
def test_mask_is_causal_nonempty_and_covers_requests(seq_len, block):
    index, vertical, slash = random_index(seq_len, seq_len=seq_len, block=block)
    mask = dense_mask(index)
    assert mask.shape == (2, 3, seq_len, seq_len)
    assert not (mask & ~torch.ones(seq_len, seq_len, dtype=torch.bool).tril()).any()
    assert mask.any(-1).all(), "every row must see at least one key"
    assert mask.diagonal(dim1=-2, dim2=-1).all(), "the local diagonal block is always kept"
    q = torch.arange(seq_len)
    for b in range(2):
        for h in range(3):
            for c in vertical[b, h][vertical[b, h] >= 0].tolist():
                assert mask[b, h, c:, c].all()
            for t in slash[b, h][slash[b, h] >= 0].tolist():
                rows = q[t:]
                assert mask[b, h, rows, rows - t].all()


def test_lists_sorted_unique_and_padded():
    index, _, _ = random_index(3)
    for lists in (index.slash, index.vertical):
        real = lists != PAD
        assert (real.sum(-1) == (index.slash_count if lists is index.slash else index.vertical_count)).all()
        assert (lists[..., 1:] > lists[..., :-1])[real[..., 1:]].all()
        assert (real[..., :-1] | ~real[..., 1:]).all(), "padding only at the tail"
    assert (index.slash[..., 0] == 0).all()


def test_num_entries_and_density_match_dense_mask():
    for seq_len, block in ((700, 64), (640, 128), (130, 128)):
        index, _, _ = random_index(seq_len + 1, seq_len=seq_len, block=block)
        mask = dense_mask(index)
        assert torch.equal(index.num_entries(), mask.sum((-1, -2)))
        causal = seq_len * (seq_len + 1) / 2
        assert index.density() == pytest.approx(mask.sum().item() / (6 * causal), rel=1e-12)


def test_derived_lists_equal_dense_mask_and_transpose():
    index, _, _ = random_index(7, seq_len=700, block=64)
    mask = dense_mask(index)
    nb, bs, s = index.num_blocks, index.block_size, index.seq_len
    rows, cols, vert = query_block_lists(index), key_block_lists(index), vertical_lists(index)
    for b in range(2):
        for h in range(3):
            transposed = {(int(j), i) for i in range(nb) for j in rows.row(b, h, i)}
            assert transposed == {(j, int(i)) for j in range(nb) for i in cols.row(b, h, j)}
            for g in range(nb):
                blocks = rows.row(b, h, g).tolist()
                assert blocks == sorted(blocks)
                keys = set()
                for j in blocks:
                    keys |= set(range(j * bs, min((j + 1) * bs, s)))
                tokens = set(vert.row(b, h, g).tolist())
                assert not tokens & keys, "a vertical column inside a read block is computed twice"
                expected = set(mask[b, h, g * bs:(g + 1) * bs].any(0).nonzero().flatten().tolist())
                assert keys | tokens == expected


def test_memory_is_independent_of_sequence_squared():
    sizes = []
    for seq_len in (4096, 65536):
        vertical = torch.arange(0, 1000).expand(1, 4, -1) * 3
        slash = torch.arange(0, 8).expand(1, 4, -1) * 256
        index = SparseIndex.from_vertical_slash(vertical, slash, seq_len, 128)
        sizes.append(index.nbytes())
    assert sizes[0] == sizes[1] < 64 * 1024


def test_striped_masks_partition_the_full_mask():
    index, _, _ = random_index(11, seq_len=768, block=64)
    full = dense_mask(index)
    world, local, bs = 3, 256, 64
    for r in range(world):
        for s in range(world):
            layout = StripedLayout(world, bs)
            qp = layout.positions(world * local, r)
            kp = layout.positions(world * local, s)
            assert torch.equal(dense_mask(index, Stripe(world, r, s)), full[:, :, qp][:, :, :, kp])


@pytest.mark.parametrize("kwargs,message", [
    (dict(vertical=torch.tensor([[[5000]]])), "vertical entries must lie in"),
    (dict(slash=torch.tensor([[[-7]]])), "slash entries must lie in"),
    (dict(vertical=torch.tensor([[[1.0]]])), "integer tensor"),
    (dict(block_size=96), "block_size=96 is unsupported"),
])
def test_bad_index_inputs(kwargs, message):
    args = dict(vertical=torch.tensor([[[1]]]), slash=torch.tensor([[[0]]]), seq_len=1024, block_size=64)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        SparseIndex.from_vertical_slash(**args)


def test_dense_mask_refuses_large_sizes():
    index = SparseIndex.from_vertical_slash(torch.zeros(1, 16, 1, dtype=torch.long),
                                            torch.zeros(1, 16, 1, dtype=torch.long), 1 << 17, 128)
    with pytest.raises(ValueError, match="too large"):
        dense_mask(index)


def test_columns_under_the_leading_diagonals_are_dropped_without_changing_the_mask():
    """A column in the last L blocks is read by every later query block through diagonals
    0..L-1 already, so the index drops it; the computed entries stay the same."""
    seq_len, block = 640, 64
    slash = torch.tensor([[[0, 1, 2, 7]]])
    vertical = torch.tensor([[[5, 400, 520, 639]]])  # blocks 0, 6, 8, 9: the last two are under 0..2
    index = SparseIndex.from_blocks(slash, vertical, seq_len, block)
    assert index.vertical[0, 0, :index.vertical_count[0, 0]].tolist() == [5, 400]
    keep_all = SparseIndex(index.slash, torch.tensor([[[5, 400, 520, 639]]], dtype=torch.int32), seq_len, block)
    assert torch.equal(dense_mask(index), dense_mask(keep_all))
    assert torch.equal(index.num_entries(), keep_all.num_entries())
