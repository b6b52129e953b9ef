"""Estimator benchmark: the torch vertical-slash estimator vs the fused CUDA one, next to sparse
attention forward+backward with the index it produces.

For each sequence length (H query heads over Hkv key/value heads, bf16 by default), times with CUDA
events (median after warm-up):

* ``estimate_torch_ms``: :func:`ds_mtraining.estimator.rule.estimate_vertical_slash`;
* ``estimate_fused_ms``: :func:`ds_mtraining.estimator.fused.estimate_vertical_slash_cuda`, plus
  its passes (``passes_ms``: row statistics, masses, each selection alone and both in the same
  launches (``select_pair``, what the estimator runs), the index);
* ``fwd_bwd_ms``: ``ds_mtraining.attention.sparse_attention`` forward+backward with the fused
  index (and ``fwd_bwd_torch_index_ms`` with the torch estimator's, whose lists are trimmed);

and reports ``share_torch`` / ``share_fused`` = estimate / (estimate + fwd_bwd), the
targets (fused <= 1 ms at 128K, <= 2 ms at 256K, share <= 5% at 64K) and how many selected
entries differ between the two indexes. Prints a table; writes JSON to a fresh directory
(``bench_results/estimate-<time>``) unless ``--out`` names a file or directory.

With ``--document-counts N ...`` it also times the document-aware estimate of the same inputs
packed from N equal documents (``documents`` in the JSON): the fused masses of all documents in
the same launches (``fused_ms``, what :func:`ds_mtraining.estimator.distributed.document_aware_index`
takes on CUDA) against the torch rule's batched windows (``torch_masses_ms``), each with the
fused selection, next to the estimate without documents (``estimate_without_documents_ms``).
Calls this small are bound by the host's launches: ``fused_kernels_ms`` is the GPU's own time
(the kernels under torch.profiler), ``fused_host_ms`` the host's per call, and
``without_documents_kernels_ms`` the kernels of the estimate without documents. The document
list is read on the host once per ``doc_start``, as in a training step, so the times are a
layer's.

    python -m ds_mtraining.bench.estimate [--seq-lens 65536 131072 262144] [--out DIR]
    python -m ds_mtraining.bench.estimate --seq-lens 131072 --skip-torch --document-counts 8 32 64 128 512
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..attention import resolve_softmax_scale
from ..record import result_record, write_json
from . import command_of, fresh_output_dir, kernel_split_ms, params_of, time_ms, wall_time_ms

TARGET_MS = {131072: 1.0, 262144: 2.0}
TARGET_SHARE = {65536: 0.05}


def index_difference(fused, expected) -> tuple[int, int]:
    """(entries in exactly one of the two indexes, entries of the torch index), over both lists."""
    from ds_mtraining.estimator.fused import trimmed
    from ds_mtraining.index import PAD
    slash, vertical = trimmed(fused)
    differing = total = 0
    for mine, theirs in ((slash, expected.slash), (vertical, expected.vertical)):
        width = max(mine.shape[-1], theirs.shape[-1])
        a = torch.nn.functional.pad(mine, (0, width - mine.shape[-1]), value=PAD).long()
        b = torch.nn.functional.pad(theirs, (0, width - theirs.shape[-1]), value=PAD).long()
        # membership by sorted search per row: both lists are sorted and PAD padded
        in_b = torch.searchsorted(b, a).clamp(max=width - 1)
        in_a = torch.searchsorted(a, b).clamp(max=width - 1)
        a_only = ((b.gather(-1, in_b) != a) & (a != PAD)).sum()
        b_only = ((a.gather(-1, in_a) != b) & (b != PAD)).sum()
        differing += int(a_only + b_only)
        total += int((b != PAD).sum())
    return differing, total


def case_inputs(seq_len, args):
    """q, k, v, dout of one length (seeded by it), on the GPU in ``args.dtype``."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    g = torch.Generator(device="cuda").manual_seed(seq_len)
    shape_q = (args.batch, seq_len, args.heads, args.dim)
    shape_k = (args.batch, seq_len, args.kv_heads, args.dim)
    q = (torch.randn(shape_q, generator=g, device="cuda") * args.sharp).to(dtype)
    k = (torch.randn(shape_k, generator=g, device="cuda") * args.sharp).to(dtype)
    v = torch.randn(shape_k, generator=g, device="cuda").to(dtype)
    dout = torch.randn(shape_q, generator=g, device="cuda").to(dtype)
    return q, k, v, dout


def run_case(seq_len, args, device_name) -> dict:  # noqa: C901 - one flat recipe
    from ds_mtraining import SparseConfig
    from ds_mtraining.estimator import fused as ec
    from ds_mtraining.attention import sparse_attention
    from ds_mtraining.estimator.rule import estimate_vertical_slash

    q, k, v, dout = case_inputs(seq_len, args)
    config = SparseConfig(block_size=args.block_size)
    scale = resolve_softmax_scale(args.dim)
    lq = min(config.last_q, seq_len)
    q_last = q[:, seq_len - lq:]
    case = dict(seq_len=seq_len, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, dim=args.dim,
                dtype=args.dtype, block_size=args.block_size, config=config.to_dict())

    fused = ec.estimate_vertical_slash_cuda(q, k, config)
    case["estimate_fused_ms"] = time_ms(lambda: ec.estimate_vertical_slash_cuda(q, k, config), args.warmup,
                                        args.repeats)
    stats = ec.row_stats(q_last, k, seq_len - lq, seq_len, scale)
    columns, diagonals = ec.masses(q_last, k, *stats, seq_len - lq, seq_len, scale)
    picks = ec.select_top_p_padded(columns, config.p_vertical, config.max_vertical)
    slashes = ec.select_top_p_padded(diagonals, config.p_slash, config.max_slash_diagonals)
    case["passes_ms"] = {
        "row_stats": time_ms(lambda: ec.row_stats(q_last, k, seq_len - lq, seq_len, scale), args.warmup, args.repeats),
        "masses": time_ms(lambda: ec.masses(q_last, k, *stats, seq_len - lq, seq_len, scale), args.warmup,
                          args.repeats),
        "select_vertical": time_ms(lambda: ec.select_top_p_padded(columns, config.p_vertical, config.max_vertical),
                                   args.warmup, args.repeats),
        "select_slash": time_ms(lambda: ec.select_top_p_padded(diagonals, config.p_slash, config.max_slash_diagonals),
                                args.warmup, args.repeats),
        # both lists in the same launches, as estimate_vertical_slash_cuda runs them
        "select_pair": time_ms(lambda: ec.select_top_p_padded_pair(columns, config.p_vertical, config.max_vertical,
                                                            diagonals, config.p_slash, config.max_slash_diagonals),
                               args.warmup, args.repeats),
        "build_index": time_ms(lambda: ec.build_index(*slashes, *picks, seq_len, config), args.warmup, args.repeats),
    }
    expected = None
    if not args.skip_torch:
        expected = estimate_vertical_slash(q, k, config)
        case["estimate_torch_ms"] = time_ms(lambda: estimate_vertical_slash(q, k, config), args.warmup,
                                            args.repeats)
        differing, total = index_difference(fused, expected)
        case["index_entries_differing"] = differing
        case["index_entries_torch"] = total
    case["vertical_width"] = fused.vertical.shape[-1]
    case["slash_width"] = fused.slash.shape[-1]
    case["density"] = fused.density()

    def fwd_bwd(index):
        def run():
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            sparse_attention(qg, kg, vg, index).backward(dout)
        return run

    case["fwd_bwd_ms"] = time_ms(fwd_bwd(fused), args.warmup, args.repeats)
    if expected is not None:
        case["fwd_bwd_torch_index_ms"] = time_ms(fwd_bwd(expected), args.warmup, args.repeats)
        case["share_torch"] = case["estimate_torch_ms"] / (case["estimate_torch_ms"] + case["fwd_bwd_ms"])
        case["estimate_speedup"] = case["estimate_torch_ms"] / case["estimate_fused_ms"]
    case["share_fused"] = case["estimate_fused_ms"] / (case["estimate_fused_ms"] + case["fwd_bwd_ms"])
    targets = {}
    if seq_len in TARGET_MS:
        targets["estimate_fused_ms_max"] = TARGET_MS[seq_len]
        targets["estimate_fused_ms_met"] = case["estimate_fused_ms"] <= TARGET_MS[seq_len]
    if seq_len in TARGET_SHARE:
        targets["share_fused_max"] = TARGET_SHARE[seq_len]
        targets["share_fused_met"] = case["share_fused"] <= TARGET_SHARE[seq_len]
    case["targets"] = targets
    return case


def kernels_ms(fn) -> float:
    """The GPU's kernel time of one ``fn()`` call (torch.profiler), milliseconds."""
    return sum(kernel_split_ms(fn, lambda name: "kernels").values())


def run_documents(seq_len, counts, args, case) -> list[dict]:
    """The document-aware estimate at each document count (module docstring), next to run_case's
    ``case`` of the same inputs without documents (its estimate, and its fwd+bwd for scale)."""
    from ds_mtraining import SparseConfig
    from ds_mtraining.estimator import fused as ec
    from ds_mtraining.documents import doc_start_from_cu_seqlens
    from ds_mtraining.estimator.rule import document_column_and_diagonal_mass

    q, k, _, _ = case_inputs(seq_len, args)  # run_case's inputs
    config = SparseConfig(block_size=args.block_size)
    scale = resolve_softmax_scale(args.dim)
    without_kernels_ms = kernels_ms(lambda: ec.estimate_vertical_slash_cuda(q, k, config))
    rows = []
    for count in counts:
        bounds = torch.linspace(0, seq_len, count + 1).round().long()
        doc_start = doc_start_from_cu_seqlens(bounds, seq_len, args.batch).cuda()

        def fused():
            columns, diagonals = ec.document_masses(q, k, doc_start, config.last_q, scale)
            return ec.index_from_document_masses(columns, diagonals, config, doc_start)

        def torch_masses():
            columns, diagonals = document_column_and_diagonal_mass(q, k, doc_start, config.last_q, scale)
            return ec.index_from_document_masses(columns, diagonals, config, doc_start)

        row = dict(seq_len=seq_len, documents=count, fused_ms=time_ms(fused, args.warmup, args.repeats),
                   torch_masses_ms=time_ms(torch_masses, args.warmup, args.repeats),
                   estimate_without_documents_ms=case["estimate_fused_ms"], fwd_bwd_ms=case["fwd_bwd_ms"])
        row.update(fused_speedup=row["torch_masses_ms"] / row["fused_ms"], fused_kernels_ms=kernels_ms(fused),
                   fused_host_ms=wall_time_ms(fused, args.repeats), without_documents_kernels_ms=without_kernels_ms)
        print(f"{seq_len:>8} {count:>6} documents: fused {row['fused_ms']:8.3f} ms (kernels "
              f"{row['fused_kernels_ms']:.3f}, host {row['fused_host_ms']:.3f}), torch masses "
              f"{row['torch_masses_ms']:8.3f} ms ({row['fused_speedup']:.1f}x); without documents "
              f"{case['estimate_fused_ms']:.3f} ms (kernels {without_kernels_ms:.3f}), fwd+bwd "
              f"{case['fwd_bwd_ms']:.2f} ms", flush=True)
        rows.append(row)
    return rows


def print_table(cases):
    header = (f"{'seq':>8} {'torch ms':>9} {'fused ms':>9} {'speedup':>8} {'fwd+bwd':>9} {'share t':>8} "
              f"{'share f':>8} {'A':>6} {'B':>6} {'selV':>6} {'selS':>6} {'sel2':>6} {'idx':>6} {'diff':>11} "
              f"{'target':>7}")
    print(header)
    for c in cases:
        p = c["passes_ms"]
        target = "".join("ok " if v else "MISS " for k, v in c["targets"].items() if k.endswith("_met")) or "-"
        diff = f"{c.get('index_entries_differing', '-')}/{c.get('index_entries_torch', '-')}"
        print(f"{c['seq_len']:>8} {c.get('estimate_torch_ms', float('nan')):>9.3f} {c['estimate_fused_ms']:>9.3f} "
              f"{c.get('estimate_speedup', float('nan')):>8.1f} {c['fwd_bwd_ms']:>9.2f} "
              f"{c.get('share_torch', float('nan')):>8.1%} {c['share_fused']:>8.2%} {p['row_stats']:>6.3f} "
              f"{p['masses']:>6.3f} {p['select_vertical']:>6.3f} {p['select_slash']:>6.3f} {p['select_pair']:>6.3f} "
              f"{p['build_index']:>6.3f} {diff:>11} {target:>7}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[65536, 131072, 262144], help="sequence lengths")
    parser.add_argument("--batch", type=int, default=1, help="batch size")
    parser.add_argument("--heads", type=int, default=16, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    parser.add_argument("--dim", type=int, default=128, help="head dimension")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="q/k/v dtype")
    parser.add_argument("--block-size", type=int, default=128, help="sparse block size")
    parser.add_argument("--sharp", type=float, default=1.0, help="q and k are randn * sharp")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs per measurement")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs (median reported)")
    parser.add_argument("--skip-torch", action="store_true", help="time only the fused estimator")
    parser.add_argument("--document-counts", type=int, nargs="*", default=[],
                        help="also time the document-aware estimate with this many equal documents")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file, or directory for estimate.json "
                             "(None: a fresh directory bench_results/estimate-<time>)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("the estimator benchmark needs a CUDA GPU")
    device_name = torch.cuda.get_device_name()
    out = args.out if args.out is not None else fresh_output_dir("estimate")
    if out.suffix != ".json":
        out.mkdir(parents=True, exist_ok=True)
        out = out / "estimate.json"
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
    cases, documents = [], []
    for seq_len in args.seq_lens:
        cases.append(run_case(seq_len, args, device_name))
        torch.cuda.empty_cache()
        print_table(cases[-1:])
        if args.document_counts:
            documents += run_documents(seq_len, args.document_counts, args, cases[-1])
            torch.cuda.empty_cache()
    result = result_record("estimate", params_of(args), cases, device=device_name,
                           command=command_of("ds_mtraining.bench.estimate", argv), documents=documents)
    write_json(out, result)
    print()
    print_table(cases)
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
