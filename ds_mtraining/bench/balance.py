"""Ring balance benchmark: how evenly block-striped vs zigzag layouts spread dynamic sparse work.

For each sequence length and target sparsity it builds a vertical-slash index with the real
estimator (:func:`~ds_mtraining.estimator.rule.estimate_vertical_slash`, run per head at the real
length) on synthetic inputs, then for each world size and layout counts the attention entries
of every (worker, ring step) from the compact index (:func:`~ds_mtraining.ring.work.pair_work`,
O(selected)) and reports the imbalance metrics of :func:`~ds_mtraining.ring.work.imbalance`.
With ``--measure`` (CUDA only) it also times the kernel (forward + backward) of every
(query rank, key rank) pair of the striped layout on one GPU.

Synthetic inputs: per head, the last ``last_q`` query rows get a designed softmax (queries are
unit vectors, key ``j`` carries the row logits of token ``j``): a local window decaying over a
few blocks (30% of each row's mass), ``n_slash`` long-range token diagonals at offsets drawn half
uniformly and half log-uniformly (60%), 256 columns including 4 strong sinks (8%) and a
log-normal background (2%). ``n_slash`` is calibrated so that the estimated index reaches the
target sparsity (``1 - index.density()``).

With ``--documents MIN MAX`` the work is counted with document masking (documents of MIN..MAX
tokens packed, random lengths: what the kernels compute inside documents), for the same indices.

    python -m ds_mtraining.bench.balance                      # W 8/16/32, S 128K and 512K
    python -m ds_mtraining.bench.balance --measure            # + kernel times (GPU)
    python -m ds_mtraining.bench.balance --documents 4096 32768
"""
from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import torch

from ..attention import resolve_softmax_scale
from ..config import SparseConfig
from ..estimator.rule import estimate_vertical_slash
from ..index import PAD, SparseIndex, Stripe
from ..layout import StripedLayout, ZigzagLayout
from ..record import result_record, write_json
from ..ring.work import imbalance, pair_work, step_work
from . import command_of, fresh_output_dir, params_of

LAYOUTS = {"striped": StripedLayout, "zigzag": ZigzagLayout}
MASS_SHARES = {"local": 0.30, "slash": 0.60, "columns": 0.08}  # background: the rest (2%)
LOCAL_BLOCKS, NUM_COLUMNS, NUM_SINKS = 4, 256, 4
GOAL_WORKER_LEVEL, GOAL_STEP_REDUCTION = 1.05, 2.3


# ---------------------------------------------------------------------- synthetic indices
def planted_row_logits(seq_len: int, last_q: int, n_slash: int, block_size: int,
                       generator: torch.Generator) -> torch.Tensor:
    """Float32 [last_q, S]: logits of the trailing query rows with the planted pattern."""
    rows = torch.arange(seq_len - last_q, seq_len)
    mass = torch.randn(last_q, seq_len, generator=generator, dtype=torch.float64).exp()
    norm = seq_len * math.exp(0.5) / (1 - sum(MASS_SHARES.values()))  # background's share: 2%

    def add_diagonals(offsets, shares):
        mass.scatter_add_(1, rows[:, None] - offsets[None, :],
                          (norm * shares).expand(last_q, -1).contiguous())

    window = torch.arange(LOCAL_BLOCKS * block_size)
    decay = torch.exp(-window.double() / (1.5 * block_size))
    add_diagonals(window, MASS_SHARES["local"] * decay / decay.sum())
    if n_slash:
        lo, hi = len(window), seq_len - last_q
        uniform = torch.rand(n_slash, generator=generator, dtype=torch.float64)
        log_uniform = torch.exp(math.log(lo) + uniform * math.log(hi / lo))
        offsets = torch.where(torch.arange(n_slash) % 2 == 0, lo + uniform * (hi - lo), log_uniform)
        weight = 0.5 + torch.rand(n_slash, generator=generator, dtype=torch.float64)
        add_diagonals(offsets.long().clamp(lo, hi - 1), MASS_SHARES["slash"] * weight / weight.sum())
    columns = torch.randperm(seq_len - last_q, generator=generator)[:NUM_COLUMNS]
    columns[:NUM_SINKS] = torch.arange(NUM_SINKS)
    weight = 0.5 + torch.rand(len(columns), generator=generator, dtype=torch.float64)
    weight[:NUM_SINKS] = 20.0
    mass[:, columns] += norm * MASS_SHARES["columns"] * weight / weight.sum()
    return mass.log().float()


def stack_heads(indices: list[SparseIndex]) -> SparseIndex:
    """One index whose heads are the given single-head indices (lists PAD-padded)."""
    def cat(lists):
        width = max(t.shape[-1] for t in lists)
        return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[-1]), value=PAD)
                          for t in lists], dim=1)
    first = indices[0]
    return SparseIndex(cat([i.slash for i in indices]), cat([i.vertical for i in indices]),
                       first.seq_len, first.block_size)


def synthetic_index(seq_len: int, heads: int, n_slash: int, config: SparseConfig, seed: int,
                    device="cpu") -> SparseIndex:
    """The estimator's index (on CPU) of ``heads`` synthetic heads, estimated one head at a time
    at the real length on ``device`` (q: unit vectors on the last rows, k: their planted logits)."""
    per_head = []
    for head in range(heads):
        generator = torch.Generator().manual_seed(seed * 1000 + head)
        logits = planted_row_logits(seq_len, config.last_q, n_slash, config.block_size, generator)
        q = torch.zeros(1, seq_len, 1, config.last_q, device=device)
        q[0, seq_len - config.last_q:, 0] = torch.eye(config.last_q, device=device)
        k = logits.T.contiguous().view(1, seq_len, 1, config.last_q).to(device)
        per_head.append(estimate_vertical_slash(q, k, config, softmax_scale=1.0).to("cpu"))
    return stack_heads(per_head)


def calibrate_slashes(seq_len: int, target_sparsity: float, config: SparseConfig, seed: int,
                      device="cpu", pilot_heads: int = 4, rounds: int = 4) -> int:
    """The number of planted long-range slashes whose estimated index is closest to the target
    sparsity on a few pilot heads (secant steps on a curve that is nearly linear)."""
    def sparsity(n):
        return 1.0 - synthetic_index(seq_len, pilot_heads, n, config, seed + 7919, device).density()

    blocks = seq_len // config.block_size
    tried = {n: sparsity(n) for n in (max(1, blocks // 50), max(2, blocks // 12))}
    for _ in range(rounds):
        # secant through the two points closest to the target (sparsity falls as n grows)
        (n0, s0), (n1, s1) = sorted(tried.items(), key=lambda kv: abs(kv[1] - target_sparsity))[:2]
        if abs(s1 - s0) < 1e-9:
            break
        n = max(1, round(n0 + (target_sparsity - s0) * (n1 - n0) / (s1 - s0)))
        if n in tried:
            break
        tried[n] = sparsity(n)
    return min(tried, key=lambda k: abs(tried[k] - target_sparsity))


# ---------------------------------------------------------------------- metrics
def layout_tables(index: SparseIndex, world: int, doc_start: torch.Tensor | None = None) -> dict:
    """Per layout: the [workers, steps] entry table (with ``doc_start``, inside documents only)
    and its imbalance metrics."""
    out = {}
    for name, layout_cls in LAYOUTS.items():
        steps = step_work(pair_work(index, layout_cls(world, index.block_size), doc_start))
        out[name] = {"steps": steps, **imbalance(steps)}
    return out


def measure_pair_times(index: SparseIndex, world: int, kv_heads: int, head_dim: int,
                       repeats: int = 3) -> torch.Tensor | None:
    """Float64 [W, W] ms of kernel forward + backward per (query rank, key rank) pair of the
    striped layout on one GPU (CUDA events, median of ``repeats``); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    from .. import ops
    device = torch.device("cuda")
    index = index.to(device)
    local = index.seq_len // world
    q = torch.randn(index.batch, local, index.heads, head_dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(index.batch, local, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    scale = resolve_softmax_scale(head_dim)
    times = torch.zeros(world, world, dtype=torch.float64)

    def run(stripe):
        out, lse = ops.attention_forward(q, k, v, index, scale, stripe)
        ops.attention_backward(dout, q, k, v, out, lse, index, scale, stripe)

    run(Stripe(world, 0, 0))  # warm-up (module load, allocator)
    for q_rank in range(world):
        for k_rank in range(world):
            stripe, samples = Stripe(world, q_rank, k_rank), []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run(stripe)
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            times[q_rank, k_rank] = sorted(samples)[len(samples) // 2]
    return times


# ---------------------------------------------------------------------- output
def plot_heatmaps(panels: list[tuple[str, torch.Tensor]], path: Path):
    """One workers x steps heatmap per panel, each normalised by its mean cell, on one scale."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 5 * rows), squeeze=False)
    top = max(float((table / table.mean()).max()) for _, table in panels)
    for ax, (title, table) in zip(axes.flat, panels):  # one colour scale: contrasts compare
        image = ax.imshow((table / table.mean()).numpy(), cmap="viridis", aspect="auto",
                          vmin=0.0, vmax=top)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("ring step")
        ax.set_ylabel("worker")
        fig.colorbar(image, ax=ax, label="work / mean cell")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(rows: list[dict], measured: bool):
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Ring balance: striped vs zigzag (work from the index"
                        + ("; measured kernel times for striped" if measured else "") + ")")
    for col in ("S", "sparsity", "W", "layout", "worker-level", "worker max/mean",
                "step-level worst", "step-level mean"):
        table.add_column(col, justify="right")
    for r in rows:
        for layout in LAYOUTS:
            m = r[layout]
            table.add_row(f"{r['seq_len'] // 1024}K", f"{r['sparsity']:.3f}", str(r["world"]), layout,
                          f"{m['worker_level']:.3f}", f"{m['worker_total']:.3f}",
                          f"{m['step_level_worst']:.2f}", f"{m['step_level_mean']:.2f}")
        if "measured_striped" in r:
            m = r["measured_striped"]
            table.add_row("", "", "", "striped (measured)", f"{m['worker_level']:.3f}",
                          f"{m['worker_total']:.3f}", f"{m['step_level_worst']:.2f}",
                          f"{m['step_level_mean']:.2f}")
    Console().print(table)


BALANCE_OUT = "bench_results/balance-<time>"  # --out's default: resolved to a new directory


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="ds-mtraining balance", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[131072, 524288])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--sparsity", type=float, nargs="+", default=[0.90, 0.95],
                        help="target sparsities (1 - index density)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2, help="for --measure")
    parser.add_argument("--head-dim", type=int, default=128, help="FLOPs and --measure")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--max-vertical", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--measure", action="store_true",
                        help="also time the kernel per (query rank, key rank) pair on one GPU")
    parser.add_argument("--documents", type=int, nargs=2, metavar=("MIN", "MAX"), default=None,
                        help="count the work with document masking: documents of MIN..MAX tokens packed")
    parser.add_argument("--out", default=BALANCE_OUT, help="output directory; by default a new one")
    parser.add_argument("--name", default="balance", help="output file stem")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    for s in args.seq_lens:
        for w in args.worlds:
            ZigzagLayout(w, args.block_size).check(s)  # the stricter of the two layouts
    if args.measure and not torch.cuda.is_available():
        print("--measure: no CUDA device here; reporting the index-derived work only")
    measure = args.measure and torch.cuda.is_available()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the estimator runs
    args.out = fresh_output_dir("balance") if args.out == BALANCE_OUT else Path(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    rows, panels, started = [], [], time.time()
    for seq_len in args.seq_lens:
        config = SparseConfig(block_size=args.block_size, max_slash_diagonals=seq_len,
                              max_vertical=args.max_vertical)
        for target in args.sparsity:
            n_slash = calibrate_slashes(seq_len, target, config, args.seed, device)
            index = synthetic_index(seq_len, args.heads, n_slash, config, args.seed, device)
            sparsity = 1.0 - index.density()
            entries = float(index.num_entries().sum())
            doc_start = None
            if args.documents:
                from .kernel import random_doc_start
                doc_start = random_doc_start(seq_len, *args.documents, torch.Generator().manual_seed(args.seed))
                entries = float(pair_work(index, StripedLayout(1, args.block_size), doc_start).sum())
            print(f"S={seq_len}: target sparsity {target:.2f} -> {n_slash} planted slashes per head, "
                  f"estimated index sparsity {sparsity:.4f} ({time.time() - started:.0f}s)", flush=True)
            for world in args.worlds:
                tables = layout_tables(index, world, doc_start)
                row = {"seq_len": seq_len, "target_sparsity": target, "sparsity": sparsity,
                       "planted_slashes": n_slash, "world": world, "entries": entries,
                       "documents": None if doc_start is None else {
                           "lengths": args.documents, "count": int(torch.unique(doc_start).numel())},
                       "fwd_bwd_flops": entries * 4 * args.head_dim * 3.5}
                for name, t in tables.items():
                    row[name] = {k: v for k, v in t.items() if k != "steps"}
                    row[name]["steps"] = t["steps"].tolist()
                row["step_level_reduction"] = (tables["zigzag"]["step_level_worst"]
                                               / tables["striped"]["step_level_worst"])
                row["step_level_mean_reduction"] = (tables["zigzag"]["step_level_mean"]
                                                    / tables["striped"]["step_level_mean"])
                if measure:
                    times = measure_pair_times(index, world, args.kv_heads, args.head_dim)
                    # striped only: the kernel takes block-striped (query rank, key rank) pairs
                    row["measured_striped"] = {**imbalance(step_work(times)),
                                               "steps_ms": step_work(times).tolist()}
                rows.append(row)
                if world == max(args.worlds) and seq_len == max(args.seq_lens):
                    for name, t in tables.items():
                        panels.append((f"{name}, S={seq_len // 1024}K, W={world}, sparsity "
                                       f"{sparsity:.3f}: worker-level {t['worker_level']:.3f}, "
                                       f"step-level worst {t['step_level_worst']:.2f}", t["steps"]))
                    if measure:
                        panels.append((f"striped measured ms, S={seq_len // 1024}K, W={world}",
                                       torch.tensor(row["measured_striped"]["steps_ms"])))
    print_table(rows, measure)
    goals = _goals(rows)
    for line in goals["lines"]:
        print(line)
    result = result_record(
        args.name, params_of(args), rows,
        device=(torch.cuda.get_device_name() if measure else
                f"CPU ({platform.processor() or platform.machine()}); work from the index"),
        command=command_of("ds_mtraining.bench.balance", sys.argv[1:] if argv is None else argv),
        torch=torch.__version__,
        synthetic_pattern={"mass_shares": MASS_SHARES, "local_blocks": LOCAL_BLOCKS, "columns": NUM_COLUMNS,
                           "sinks": NUM_SINKS, "heads": args.heads, "block_size": args.block_size,
                           "max_vertical": args.max_vertical, "max_slash_diagonals": "seq_len",
                           "p_vertical": 0.9, "p_slash": 0.9, "last_q": 64},
        goals={k: v for k, v in goals.items() if k != "lines"}, seconds=round(time.time() - started, 1))
    json_path = write_json(args.out / f"{args.name}.json", result)
    png_path = args.out / f"{args.name}.png"
    plot_heatmaps(panels, png_path)
    print(f"wrote {json_path} and {png_path}")
    return 0


def _goals(rows: list[dict]) -> dict:
    """The balance goals at the widest world, for each sequence length, stated as met or missed."""
    widest = max(r["world"] for r in rows)
    goals, lines = {"world": widest, "by_seq_len": {}}, []
    for seq_len in sorted({r["seq_len"] for r in rows}):
        at = [r for r in rows if r["world"] == widest and r["seq_len"] == seq_len]
        worker = max(r["striped"]["worker_level"] for r in at)
        reduction = min(r["step_level_reduction"] for r in at)
        goals["by_seq_len"][seq_len] = {"striped_worker_level_worst": worker,
                                        "step_level_reduction_least": reduction,
                                        "worker_level_met": worker <= GOAL_WORKER_LEVEL,
                                        "step_level_met": reduction >= GOAL_STEP_REDUCTION}
        lines.append(
            f"S={seq_len // 1024}K, W={widest}: striped worker-level {worker:.3f} (goal <= "
            f"{GOAL_WORKER_LEVEL}: {'met' if worker <= GOAL_WORKER_LEVEL else 'MISSED'}); step-level "
            f"{reduction:.2f}x lower than zigzag (goal >= {GOAL_STEP_REDUCTION}x: "
            f"{'met' if reduction >= GOAL_STEP_REDUCTION else 'MISSED'}); worst over the sparsities")
    goals["lines"] = lines
    return goals


if __name__ == "__main__":
    sys.exit(main())
