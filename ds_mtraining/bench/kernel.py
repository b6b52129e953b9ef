"""Kernel benchmark: our CUDA sparse attention vs FlexAttention on the identical mask vs dense flash.

For each sequence length and target density, builds a vertical-slash index (sink tokens, clustered
vertical columns, local and random slash diagonals), then times with CUDA events (median after
warm-up) forward and forward+backward of

* ``mtraining``: ``ds_mtraining.sparse_attention`` (the CUDA op, index derivation included);
* ``flex``: ``torch.nn.attention.flex_attention`` (compiled) with a BlockMask from the same blocks
  (``BlockMask.from_kv_blocks``: slash blocks full, diagonal and vertical-column blocks partial
  with a mask_mod reading the same lists), so it computes exactly the same entries;
* ``dense``: dense causal attention, once per length (density-independent) and per
  ``--dense-backend`` (:mod:`ds_mtraining.dense_backend`: ``sdpa``, torch SDPA held to its flash
  backend; ``fa4``, FlashAttention-4; ``auto``, the run's rule; several time each in one run, e.g.
  ``--dense-backend sdpa fa4``), on the same [B, S, H, D] tensors the training path hands them;
  each sparse row says its speedup against each (``speedup_vs_dense_<backend>_fwd_bwd``);

plus ``index``: the per-call list derivation on the GPU (``step_index``). Effective TFLOP/s =
computed entries x 4 x D per forward (x 3.5 for forward+backward). Prints a table and writes JSON
(date, device, command) that ``ds_mtraining.bench.comm --kernel-json`` reads. ``--skip-sparse``
times the dense rows alone (no sparse op, no FlexAttention).

With ``--documents MIN MAX`` the sequence is also packed with documents of MIN..MAX tokens
(random lengths, the last one cut at S), every document's first tokens are sink columns (as the
document-aware estimator selects them), and each density adds ``mtraining_documents`` (the same
index with document masking, ``doc_start``) and ``flex_documents`` (FlexAttention with the
combined mask: its block lists drop the key blocks before a query block's first document and its
mask_mod adds ``kv >= doc_start[q]``). The FLOP counts stay those of the index without documents,
so the TFLOP/s columns compare times, not work done. With ``fa4`` among the dense backends each
length also gets ``dense_documents``: FA4's varlen path (``cu_seqlens``) over the same documents,
its TFLOP/s counted from the document-masked causal entries (the work it does); the
``mtraining_documents`` rows say their speedup against it. SDPA has no varlen path.

With ``--kernel-split`` every row also gets ``kernel_ms``: one forward+backward's CUDA time per
kernel (torch.profiler; ours by pass: forward, dq, dkdv_slash, dkdv_vertical).

With ``--head-dims D ...`` the whole benchmark runs once per head_dim (FlexAttention at the same
D; a head_dim the kernels lack runs zero-padded, as training runs it), in one process, and the
JSON is a study: ``{"study", "device", "commit", "dirty", "runs": [one result per head_dim]}``.

    python -m ds_mtraining.bench.kernel [--seq-lens 32768 65536 131072] [--densities 0.03 0.05 0.1]
    python -m ds_mtraining.bench.kernel --seq-lens 131072 --documents 4096 32768 --kernel-split
    python -m ds_mtraining.bench.kernel --seq-lens 32768 131072 524288 --dense-backend sdpa fa4 --skip-sparse
    python -m ds_mtraining.bench.kernel --seq-lens 131072 --densities 0.05 --skip-dense --head-dims 64 96 128 256
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from ..dense_backend import (DENSE_BACKENDS, DenseBackendError, dense_causal_attention, fa4_document_attention,
                             resolve_dense_backend)
from ..record import result_record, write_json
from . import fresh_output_dir, index_for_density, kernel_split_ms, params_of, time_ms

SINK_TOKENS = 64
HOT_BLOCKS = 16           # key blocks holding clustered vertical columns, per head
COLUMNS_PER_HOT_BLOCK = 16
FWD_BWD_FLOP_FACTOR = 3.5
OUR_PASSES = {("query_kernel", False): "forward", ("query_kernel", True): "dq",
              ("specialized_query_kernel", False): "forward", ("specialized_query_kernel", True): "dq",
              ("key_kernel", False): "dkdv_slash", ("key_kernel", True): "dkdv_vertical"}


def kernel_label(name: str) -> str:
    """Our attention kernels by pass (their last template argument is kBackward / kVertical);
    any other kernel by its name up to the template or argument list, at most 60 characters."""
    base = name.split("<")[0].split("(")[0].replace("void ", "").split("::")[-1]
    template = name.split("(")[0]
    if base in ("query_kernel", "specialized_query_kernel", "key_kernel") and template.endswith(">"):
        return OUR_PASSES[(base, template.rstrip(">").rstrip().endswith("true"))]
    return (base or name)[:60]


def build_index(batch, heads, seq, block, n_slash, generator, document_starts=(0,)):
    """A vertical-slash index: sinks (the first SINK_TOKENS of every document in
    ``document_starts``, as the document-aware estimator finds them) + clustered columns,
    diagonals 0..1 + n_slash others (half of them drawn near the diagonal, half anywhere)."""
    from ds_mtraining.index import SparseIndex
    blocks = seq // block
    weight = torch.where(torch.arange(blocks) < 64, 8.0, 1.0)
    scores = torch.rand(batch, heads, blocks, generator=generator) * weight
    scores[..., :2] = -1.0  # diagonals 0 and 1 are added as local blocks
    slash = scores.topk(min(n_slash, blocks - 2), dim=-1).indices
    hot = torch.randint(1, blocks, (batch, heads, HOT_BLOCKS), generator=generator)
    offsets = torch.randint(0, block, (batch, heads, HOT_BLOCKS, COLUMNS_PER_HOT_BLOCK), generator=generator)
    columns = (hot[..., None] * block + offsets).flatten(2)
    sinks = torch.cat([torch.arange(start, min(start + SINK_TOKENS, seq)) for start in document_starts])
    vertical = torch.cat([sinks.expand(batch, heads, -1), columns], -1)
    return SparseIndex.from_blocks(slash, vertical, seq, block, local_blocks=2)


def benchmark_index(batch, heads, seq, block, target, document_starts=(0,)):
    """The benchmark's index at one (length, target density): build_index with the number of
    slash diagonals that comes closest to ``target``, from a seed of the length and density."""
    seed = seq + int(target * 1000)
    return index_for_density(
        lambda n: build_index(batch, heads, seq, block, n, torch.Generator().manual_seed(seed), document_starts),
        seq // block - 2, target)


def benchmark_doc_start(seq, shortest, longest):
    """The benchmark's documents at one length (``--documents SHORTEST LONGEST``): random_doc_start
    from a seed of the length."""
    return random_doc_start(seq, shortest, longest, torch.Generator().manual_seed(seq))


def random_doc_start(seq, shortest, longest, generator):
    """int32 [1, S] doc_start of documents with lengths uniform in [shortest, longest] (the last
    one cut at S)."""
    from ds_mtraining.documents import doc_start_from_cu_seqlens
    bounds = [0]
    while bounds[-1] < seq:
        length = int(torch.randint(shortest, longest + 1, (1,), generator=generator))
        bounds.append(min(seq, bounds[-1] + length))
    return doc_start_from_cu_seqlens(torch.tensor(bounds), seq)


class FlexMask:
    """BlockMasks with exactly an index's entries: full slash blocks, partial diagonal and
    vertical-column blocks, mask_mod = causal & (slash diagonal | vertical column); with
    ``doc_start`` ([B, S]) also ``& kv >= doc_start[q]``: key blocks wholly before a query block's
    first document are dropped and blocks that a document boundary cuts become partial.

    The mask_mod reads membership buffers that belong to this object and are refilled per index,
    so the compiled flex_attention is not recompiled for each mask of one shape."""

    def __init__(self, batch, heads, seq, block, device, doc_start=None):
        self.block, self.blocks = block, seq // block
        self.seq_len = seq
        self.doc_start = doc_start
        self.in_slash = torch.zeros(batch, heads, self.blocks, dtype=torch.bool, device=device)
        self.in_vertical = torch.zeros(batch, heads, seq, dtype=torch.bool, device=device)
        in_slash, in_vertical = self.in_slash, self.in_vertical

        def mask_mod(b, h, q_idx, kv_idx):
            diagonal = q_idx // block - kv_idx // block
            return (q_idx >= kv_idx) & (in_slash[b, h, diagonal.clamp(min=0)] | in_vertical[b, h, kv_idx])

        def document_mask_mod(b, h, q_idx, kv_idx):
            return mask_mod(b, h, q_idx, kv_idx) & (kv_idx >= doc_start[b, q_idx])

        self.mask_mod = mask_mod if doc_start is None else document_mask_mod

    def for_index(self, index):
        """(BlockMask, fraction of the causal blocks that flex computes)."""
        from torch.nn.attention.flex_attention import BlockMask
        from ds_mtraining.index import membership
        nb, device = self.blocks, self.in_slash.device
        self.in_slash.copy_(membership(index.slash, nb))
        self.in_vertical.copy_(membership(index.vertical, self.seq_len))
        q_block = torch.arange(nb, device=device)[:, None]
        k_block = torch.arange(nb, device=device)[None, :]
        below = q_block > k_block
        slash_blocks = self.in_slash[..., (q_block - k_block).clamp(min=0)] & below
        column_blocks = self.in_vertical.view(*self.in_vertical.shape[:2], nb, self.block).any(-1)[..., None, :] & below
        partial = (column_blocks & ~slash_blocks) | (q_block == k_block)
        if self.doc_start is not None:
            # doc_start is non-decreasing: a query block's first row has the earliest start, its
            # last row the latest; key blocks ending before the earliest are empty, key blocks
            # starting at or after the latest are untouched by the document mask.
            starts = self.doc_start.view(-1, nb, self.block)[:, None, :, :]
            k_first = torch.arange(nb, device=device) * self.block
            reached = (k_first + self.block)[None, None, None, :] > starts[..., :1]
            whole = k_first[None, None, None, :] >= starts[..., -1:]
            partial = (partial | (slash_blocks & ~whole)) & reached
            slash_blocks = slash_blocks & whole & reached

        def to_lists(blocks):
            order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
            return blocks.sum(-1, dtype=torch.int32), order

        mask = BlockMask.from_kv_blocks(*to_lists(partial), *to_lists(slash_blocks), BLOCK_SIZE=self.block,
                                        mask_mod=self.mask_mod, seq_lengths=(self.seq_len, self.seq_len))
        computed = float((partial | slash_blocks).double().mean())
        return mask, computed / ((nb + 1) / (2 * nb))


def fwd_bwd_pair(seq, target, documents=None, heads=16, kv_heads=2, dim=128, block=128, device="cuda"):
    """One fwd+bwd of ours and of compiled FlexAttention on the benchmark's index at (seq,
    target) and, with ``documents`` (MIN, MAX), its packed documents masking both sides, on fresh
    bf16 inputs (the scripts that profile or probe one case: benchmarks/probes/ncu_flex_case.py,
    benchmarks/probes/power_probe.py). Returns ({"ours": fn, "flex": fn}, a line of the case's densities)."""
    from torch.nn.attention.flex_attention import flex_attention

    from ds_mtraining.attention import resolve_softmax_scale, sparse_attention
    doc_start, starts = None, (0,)
    if documents:
        doc_start = benchmark_doc_start(seq, *documents).to(device)
        starts = torch.unique(doc_start).tolist()
    index = benchmark_index(1, heads, seq, block, target, starts).to(device)
    q, dout = (torch.randn(1, seq, heads, dim, device=device, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, seq, kv_heads, dim, device=device, dtype=torch.bfloat16) for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    scale = resolve_softmax_scale(dim)
    block_mask, block_density = FlexMask(1, heads, seq, block, device, doc_start).for_index(index)
    flex = torch.compile(flex_attention, dynamic=False)
    qf, kf, vf, df = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v, dout))
    sides = {
        "ours": lambda: torch.autograd.grad(sparse_attention(q, k, v, index, scale, doc_start=doc_start),
                                            (q, k, v), dout),
        "flex": lambda: torch.autograd.grad(flex(qf, kf, vf, block_mask=block_mask, scale=scale, enable_gqa=True),
                                            (qf, kf, vf), df),
    }
    described = (f"density: ours {index.density():.4f}, flex's blocks {block_density:.4f}"
                 + (f"; {len(starts)} documents" if doc_start is not None else ""))
    return sides, described


def dense_backends(settings) -> dict:
    """{kernel name: why} of the ``--dense-backend`` settings, each kernel once, in the order given;
    a setting that cannot run here stops the benchmark with its one line."""
    resolved = {}
    for setting in settings:
        try:
            backend = resolve_dense_backend(setting, key="--dense-backend")
        except DenseBackendError as error:
            raise SystemExit(f"bench.kernel: {error}") from None
        resolved.setdefault(backend.name, backend.why)
    return resolved


def dense_forward(q, k, v, scale, backend: str):
    """The dense row's attention: ``dense_causal_attention``, SDPA held to its flash backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if backend == "sdpa":
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return dense_causal_attention(q, k, v, scale, backend)
    return dense_causal_attention(q, k, v, scale, backend)


def dense_documents_forward(q, k, v, doc_start, scale):
    """The ``dense_documents`` row's attention (FA4's varlen path over ``doc_start``'s documents, B = 1)
    and its document-masked causal entries per head."""
    from ds_mtraining.documents import cu_seqlens_from_doc_start
    cu = cu_seqlens_from_doc_start(doc_start[0])
    lengths = (cu[1:] - cu[:-1]).double()
    cu, longest = cu.to(device=q.device, dtype=torch.int32), int(lengths.max())
    seq, heads, dim = q.shape[1:]

    def forward():
        return fa4_document_attention(q.view(seq, heads, dim), k.view(seq, -1, dim), v.view(seq, -1, dim), cu,
                                      longest, scale).view(q.shape)
    return forward, float((lengths * (lengths + 1) / 2).sum())


def run(args):
    from rich.console import Console
    from rich.table import Table

    from ds_mtraining import ops
    from ds_mtraining.attention import resolve_softmax_scale, sparse_attention

    device = torch.device("cuda")
    dtype = torch.bfloat16
    batch, heads, kv_heads, dim, block = 1, args.heads, args.kv_heads, args.head_dim, args.block_size
    scale = resolve_softmax_scale(dim)
    backends = {} if args.skip_dense else dense_backends(args.dense_backend)
    densities = [] if args.skip_sparse else args.densities
    module = paths = None
    if densities:
        module = ops.op_module("cuda")
        paths = dict(module.kernel_paths(torch.cuda.current_device()))  # tensor_cores, tma (env-dependent)
    flex = None
    if densities and not args.skip_flex:
        from torch.nn.attention.flex_attention import flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    result = result_record("kernel", params_of(args), rows, torch=torch.__version__,
                           environment={name: os.environ[name] for name in sorted(os.environ)
                                        if name.startswith("DS_MTRAINING_CUDA_")},
                           shape=dict(batch=1, heads=heads, kv_heads=kv_heads, head_dim=dim, block_size=block,
                                      dtype="bf16"),
                           flop_convention="effective = computed entries x 4 x D per forward, x3.5 for fwd+bwd",
                           dense_backends=backends)

    def save():  # after every row, so that a cut-off run still leaves its numbers
        write_json(args.out, result)

    for seq in args.seq_lens:
        generator = torch.Generator(device=device).manual_seed(seq)
        q, k, v, dout = (torch.randn(batch, seq, h, dim, device=device, dtype=dtype, generator=generator)
                         for h in (heads, kv_heads, kv_heads, heads))
        q.requires_grad_(), k.requires_grad_(), v.requires_grad_()

        def time_both(forward, inputs=(q, k, v), grad_out=dout, warmup=3, repeats=args.repeats):
            """(forward ms, forward+backward ms) of ``forward``."""
            fwd = time_ms(forward, warmup, repeats)
            return fwd, time_ms(lambda: torch.autograd.grad(forward(), inputs, grad_out), warmup, repeats)

        def split(forward, inputs=(q, k, v), grad_out=dout):
            """``kernel_ms`` of one forward+backward of ``forward`` (with --kernel-split)."""
            if not args.kernel_split:
                return {}
            return dict(kernel_ms=kernel_split_ms(lambda: torch.autograd.grad(forward(), inputs, grad_out),
                                                  kernel_label))

        def dense_row(impl, backend, forward, entries):
            """A dense row: ``entries`` causal entries per head, each 4 x D FLOPs per forward."""
            dense_ms = time_both(forward, warmup=1, repeats=3 if seq > 65536 else 5)
            flops = 4.0 * batch * heads * dim * entries
            row = dict(impl=impl, backend=backend, seq_len=seq, density=1.0, fwd_ms=dense_ms[0],
                       fwd_bwd_ms=dense_ms[1], fwd_tflops=flops / dense_ms[0] / 1e9,
                       fwd_bwd_tflops=FWD_BWD_FLOP_FACTOR * flops / dense_ms[1] / 1e9, **split(forward))
            rows.append(row)
            save()
            print(json.dumps(row), flush=True)
            return row

        def documents_rows(plain, index, doc_start, flex_masks, dense_documents):
            """Rows of the same index with document masking: ours (vs the plain row, vs flex
            with the combined mask and vs FA4's varlen dense attention) and flex's."""
            def documents_forward():
                return sparse_attention(q, k, v, index, scale, doc_start=doc_start)

            ours = time_both(documents_forward)
            row = {key: value for key, value in plain.items() if not key.startswith("speedup_vs_")}
            row.update(impl="mtraining_documents", fwd_ms=ours[0], fwd_bwd_ms=ours[1],
                       fwd_tflops=plain["fwd_tflops"] * plain["fwd_ms"] / ours[0],
                       fwd_bwd_tflops=plain["fwd_bwd_tflops"] * plain["fwd_bwd_ms"] / ours[1],
                       speedup_vs_no_documents_fwd_bwd=plain["fwd_bwd_ms"] / ours[1], **split(documents_forward))
            if dense_documents is not None:
                row["speedup_vs_dense_documents_fa4_fwd_bwd"] = dense_documents["fwd_bwd_ms"] / ours[1]
            out = [row]
            if flex_masks is not None:
                block_mask, block_density = flex_masks.for_index(index)
                qf, kf, vf, df = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v, dout))

                def flex_forward():
                    return flex(qf, kf, vf, block_mask=block_mask, scale=scale, enable_gqa=True)

                flex_ms = time_both(flex_forward, (qf, kf, vf), df)
                out.append(dict(impl="flex_documents", seq_len=plain["seq_len"], density=plain["density"],
                                target_density=plain["target_density"], block_density=block_density,
                                fwd_ms=flex_ms[0], fwd_bwd_ms=flex_ms[1],
                                fwd_tflops=row["fwd_tflops"] * ours[0] / flex_ms[0],
                                fwd_bwd_tflops=row["fwd_bwd_tflops"] * ours[1] / flex_ms[1],
                                **split(flex_forward, (qf, kf, vf), df)))
                row["speedup_vs_flex_fwd"] = flex_ms[0] / ours[0]
                row["speedup_vs_flex_fwd_bwd"] = flex_ms[1] / ours[1]
            print(json.dumps(row), flush=True)
            return out

        doc_start, starts = None, (0,)
        if args.documents:
            doc_start = benchmark_doc_start(seq, *args.documents).to(device)
            starts = torch.unique(doc_start).tolist()
            result.setdefault("documents", {})[seq] = dict(lengths=args.documents, count=len(starts),
                                                           sinks="the first 64 tokens of every document")
        dense_rows = {backend: dense_row("dense", backend, lambda b=backend: dense_forward(q, k, v, scale, b),
                                         seq * (seq + 1) / 2) for backend in backends}
        dense_documents = None
        if doc_start is not None and "fa4" in backends:
            forward, entries = dense_documents_forward(q, k, v, doc_start, scale)
            dense_documents = dense_row("dense_documents", "fa4", forward, entries)
        flex_masks = FlexMask(batch, heads, seq, block, device) if flex is not None else None
        flex_documents = (FlexMask(batch, heads, seq, block, device, doc_start)
                          if flex is not None and doc_start is not None else None)
        for target in densities:
            index = benchmark_index(batch, heads, seq, block, target, starts).to(device)
            density = index.density()
            flops = 4.0 * dim * float(index.num_entries().sum())

            def ours_forward():
                return sparse_attention(q, k, v, index, scale)

            ours_fwd, ours_fwd_bwd = time_both(ours_forward)
            index_ms = time_ms(lambda: module.step_index(ops.op_index(index), seq), repeats=args.repeats)
            row = dict(impl="mtraining", seq_len=seq, density=density, target_density=target,
                       **paths,
                       slash_per_head=int(index.slash_count.float().mean()),
                       vertical_per_head=int(index.vertical_count.float().mean()),
                       fwd_ms=ours_fwd, fwd_bwd_ms=ours_fwd_bwd, index_ms=index_ms,
                       index_share_of_fwd_bwd=index_ms / ours_fwd_bwd,
                       fwd_tflops=flops / ours_fwd / 1e9,
                       fwd_bwd_tflops=FWD_BWD_FLOP_FACTOR * flops / ours_fwd_bwd / 1e9, **split(ours_forward))
            if flex is not None:
                block_mask, flex_block_density = flex_masks.for_index(index)
                qf, kf, vf, df = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v, dout))

                def flex_forward():
                    return flex(qf, kf, vf, block_mask=block_mask, scale=scale, enable_gqa=True)

                flex_fwd, flex_fwd_bwd = time_both(flex_forward, (qf, kf, vf), df)
                rows.append(dict(impl="flex", seq_len=seq, density=density, target_density=target,
                                 block_density=flex_block_density, fwd_ms=flex_fwd, fwd_bwd_ms=flex_fwd_bwd,
                                 fwd_tflops=flops / flex_fwd / 1e9,
                                 fwd_bwd_tflops=FWD_BWD_FLOP_FACTOR * flops / flex_fwd_bwd / 1e9,
                                 **split(flex_forward, (qf, kf, vf), df)))
                row["speedup_vs_flex_fwd"] = flex_fwd / ours_fwd
                row["speedup_vs_flex_fwd_bwd"] = flex_fwd_bwd / ours_fwd_bwd
                del qf, kf, vf, df, block_mask
            for backend, dense in dense_rows.items():
                row[f"speedup_vs_dense_{backend}_fwd_bwd"] = dense["fwd_bwd_ms"] / ours_fwd_bwd
            rows.append(row)
            if doc_start is not None:
                rows.extend(documents_rows(row, index, doc_start, flex_documents, dense_documents))
            save()
            print(json.dumps(row), flush=True)
        # free this length's tensors before the next: the closures above (time_both's defaults
        # among them) hold them too
        q = k = v = dout = time_both = split = dense_row = documents_rows = None
        torch.cuda.empty_cache()

    speedups = [f"speedup_vs_dense_{backend}_fwd_bwd" for backend in backends]
    table = Table(title=f"sparse attention, H={heads} HKV={kv_heads} D={dim} bf16, {result['device']}")
    for column in ("S", "density", "impl", "fwd ms", "fwd TF/s", "fwd+bwd ms", "fwd+bwd TF/s", "vs flex",
                   f"vs dense {'/'.join(backends)}"):
        table.add_column(column, justify="right")
    for r in rows:
        impl = " ".join(filter(None, (r["impl"], r.get("backend"))))
        table.add_row(f"{r['seq_len'] // 1024}K", f"{r['density']:.3f}", impl, f"{r['fwd_ms']:.2f}",
                      f"{r['fwd_tflops']:.0f}", f"{r['fwd_bwd_ms']:.2f}", f"{r['fwd_bwd_tflops']:.0f}",
                      f"{r['speedup_vs_flex_fwd_bwd']:.2f}x" if "speedup_vs_flex_fwd_bwd" in r else "",
                      " / ".join(f"{r[key]:.1f}x" for key in speedups if key in r))
    Console(width=140).print(table)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="CUDA sparse attention vs FlexAttention vs dense flash",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.03, 0.05, 0.10])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--head-dims", type=int, nargs="+", default=None,
                        help="a study: the benchmark at each of these head dims, one JSON (overrides --head-dim)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--skip-flex", action="store_true")
    parser.add_argument("--skip-dense", action="store_true")
    parser.add_argument("--skip-sparse", action="store_true",
                        help="the dense rows alone (no sparse op, no FlexAttention)")
    parser.add_argument("--dense-backend", nargs="+", choices=DENSE_BACKENDS, default=["auto"],
                        help="the dense rows' kernels (ds_mtraining.dense_backend), each timed: e.g. sdpa fa4")
    parser.add_argument("--documents", type=int, nargs=2, metavar=("MIN", "MAX"), default=None,
                        help="also time the same indexes with documents of MIN..MAX tokens packed")
    parser.add_argument("--kernel-split", action="store_true",
                        help="also profile one forward+backward per row: CUDA ms per kernel (kernel_ms)")
    parser.add_argument("--out", default="bench_results/kernel-<time>/kernel.json",
                        help="JSON file; by default in a new directory")
    return parser


def head_dim_study(args) -> dict:
    """:func:`run` at each of ``args.head_dims`` (each writing its own file next to ``args.out``
    while it runs, removed once in the study), the study written to ``args.out`` after each."""
    out, runs = Path(args.out), []
    for dim in args.head_dims:
        part = out.with_name(f"{out.stem}_d{dim}{out.suffix}")
        runs.append(run(argparse.Namespace(**{**vars(args), "head_dim": dim, "head_dims": None, "out": str(part)})))
        study = {"study": f"bench.kernel at head_dim {', '.join(str(d) for d in args.head_dims)}, one process",
                 "device": runs[0]["device"], "commit": runs[-1]["commit"], "dirty": runs[-1]["dirty"], "runs": runs}
        write_json(out, study)
        part.unlink()
    return study


def main(argv=None):
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the kernel benchmark needs a CUDA GPU")
    if args.out == build_parser().get_default("out"):
        args.out = str(fresh_output_dir("kernel") / "kernel.json")
    if args.head_dims:
        head_dim_study(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
