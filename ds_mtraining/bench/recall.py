"""Recall-vs-density Pareto curves of vertical-slash estimators.

    python -m ds_mtraining.bench.recall                       # -> ./bench_results/recall-<time>/
    python -m ds_mtraining.bench.recall --checkpoint runs/demo --out OUT

Recall is the share of the exact causal softmax mass over ALL query rows that an index keeps, per
head (:mod:`ds_mtraining.recall`); density is its computed entries over the causal entries.
Inputs: planted RoPE patterns (:func:`ds_mtraining.synthetic.planted_qk`) at ``--seq-lens`` and,
with ``--checkpoint`` (a ``scripts/train_demo.sh`` save directory), post-RoPE q/k captured from
every attention layer of that model on held-out text at ``--demo-seq-lens``. Methods:

* ``token-diagonal``: the shipped estimator (:func:`~ds_mtraining.estimator.rule.estimate_vertical_slash`),
  over a top-p sweep; ``default`` marks ``SparseConfig()``;
* ``block-pooled``: the previous rule (mass pooled per block diagonal over the last rows, cap
  ``max_slash_diagonals // block_size`` block diagonals), same sweep;
* ``reference``: the MTraining reference rule, re-implemented from its description
  (:func:`reference_rule_index`, comparison only), top-p 0.9, caps 4096;
* ``static``: sink tokens plus a local window of w block diagonals;
* ``oracle``: the best blocks by true mass at the densities of the token-diagonal points.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from .. import synthetic
from ..attention import resolve_softmax_scale
from ..config import SparseConfig
from ..estimator.rule import estimate_vertical_slash, last_query_scores, select_top_p, sink_columns
from ..index import SparseIndex
from ..recall import attention_recall, oracle_recall
from ..record import result_record, write_json
from . import command_of, fresh_output_dir, index_for_density, params_of

TOP_PS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99)
REFERENCE_P, REFERENCE_CAP = 0.9, 4096
HEAD_SLACK = 0.05  # no head may fall further below the reference rule
# planted pattern per kv head: one token diagonal (most not block multiples) and a few columns
PLANTED_OFFSETS = (200, 777, 1500, 3000)
PLANTED_COLUMNS = ((5, 900), (1234,), (50, 2000, 3100), (2222,))


# ----------------------------------------------------------------------------- the compared rules
@torch.no_grad()
def block_pooled_index(q, k, config: SparseConfig, softmax_scale=None) -> SparseIndex:
    """The previous estimator: the last rows' mass pooled per block diagonal (query block minus key
    block), top-p over those, capped at ``max_slash_diagonals // block_size`` block diagonals."""
    b, s, h, d = q.shape
    lq, bs = min(config.last_q, s), config.block_size
    pos = torch.arange(s, device=q.device)
    probs = torch.softmax(last_query_scores(q[:, s - lq:], k, pos[s - lq:], pos,
                                            resolve_softmax_scale(d, softmax_scale)), -1)
    nb = -(-s // bs)
    offset = (pos[s - lq:, None] // bs - pos[None, :] // bs).clamp(0, nb - 1).flatten()
    diagonals = torch.zeros(b, h, nb, dtype=probs.dtype, device=q.device)
    diagonals.scatter_add_(-1, offset.expand(b, h, -1), probs.flatten(2))
    vertical = select_top_p(probs.sum(-2) / lq, config.p_vertical, config.max_vertical)
    vertical = torch.cat([vertical, sink_columns(b, h, config, s, q.device)], -1)
    slash = select_top_p(diagonals / lq, config.p_slash, max(1, config.max_slash_diagonals // bs))
    return SparseIndex.from_blocks(slash, vertical, s, bs, config.local_blocks)


def _reference_top_p(mass: torch.Tensor, p: float, cap: int) -> list[int]:
    """Positions of the fewest largest entries (ties: lower position first) reaching p of the
    total, at least 1 and at most cap."""
    order = sorted(range(mass.numel()), key=lambda i: (-mass[i].item(), i))
    running, kept, goal = 0.0, [], p * float(mass.sum())
    for i in order:
        if kept and (running >= goal or len(kept) == cap):
            break
        kept.append(i)
        running += mass[i].item()
    return kept


@torch.no_grad()
def reference_rule_index(q, k, config: SparseConfig, softmax_scale=None) -> SparseIndex:
    """The MTraining reference rule from its description, head by head (comparison only): the
    last ``last_q`` queries' causal softmax; vertical = top-p over per-token column masses (cap
    ``max_vertical``); slash = top-p over per-token diagonal masses (cap ``max_slash_diagonals``),
    each kept token diagonal marking the block diagonal(s) it touches; sinks and local blocks kept."""
    b, s, h, d = q.shape
    lq, group = min(config.last_q, s), h // k.shape[2]
    scale = resolve_softmax_scale(d, softmax_scale)
    rows, keys = torch.arange(s - lq, s), torch.arange(s)
    diagonal_of = rows[:, None] - keys[None, :]
    causal = diagonal_of >= 0
    vertical, slash = [], []
    for bi in range(b):
        for hi in range(h):
            logits = q[bi, s - lq:, hi].double().cpu() @ k[bi, :, hi // group].double().cpu().T * scale
            probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)
            diagonal_mass = torch.zeros(s, dtype=torch.float64).index_add_(0, diagonal_of[causal], probs[causal])
            vertical.append(_reference_top_p(probs.sum(0), config.p_vertical, config.max_vertical)
                            + list(range(min(config.sink_tokens, s))))
            slash.append(_reference_top_p(diagonal_mass, config.p_slash, config.max_slash_diagonals))

    def padded(lists):
        width = max(len(x) for x in lists)
        return torch.tensor([x + [-1] * (width - len(x)) for x in lists]).view(b, h, width)

    return SparseIndex.from_vertical_slash(padded(vertical), padded(slash), s, config.block_size,
                                           config.local_blocks).to(q.device)


def static_index(batch, heads, seq_len, config: SparseConfig, window_blocks: int, device) -> SparseIndex:
    """Sink tokens plus the ``window_blocks`` nearest block diagonals, for every head."""
    local = torch.arange(window_blocks, device=device).expand(batch, heads, -1)
    return SparseIndex.from_blocks(local, sink_columns(batch, heads, config, seq_len, device), seq_len,
                                   config.block_size)


# ----------------------------------------------------------------------------- inputs
def planted_inputs(seq_len: int, seed: int, device) -> list[tuple]:
    """One planted q/k [1, S, 8, 64] (4 kv heads): (name, q, k, softmax_scale)."""
    columns = tuple(tuple(c for c in cols if c < seq_len) for cols in PLANTED_COLUMNS)
    q, k = synthetic.planted_qk(seq_len, 8, 4, 64, offsets=PLANTED_OFFSETS, columns=columns, seed=seed)
    return [(f"planted S={seq_len}", q.to(device), k.to(device), None)]


def demo_inputs(checkpoint: Path, seq_len: int, device) -> list[tuple]:
    """Post-RoPE q/k [1, S, H, D] of every attention layer of the latest checkpoint in a
    ``scripts/train_demo.sh`` save directory, on the corpus's last ``seq_len`` tokens (one
    process; the model is rebuilt from the run config stored with the checkpoint)."""
    from transformers import AttentionInterface

    from ..data import PackedSequences, datasets_offline, load_documents, load_tokenizer, tokenize_documents
    from ..training.checkpoint import load_weights_only
    from ..training.model import build_model

    latest = checkpoint / "latest"
    if not latest.is_file():
        raise FileNotFoundError(f"{checkpoint} holds no DeepSpeed checkpoint ('latest' is missing); "
                                f"train one with: bash scripts/train_demo.sh (SAVE_DIR={checkpoint})")
    tag = latest.read_text().strip()
    states = load_weights_only(checkpoint / tag / "mp_rank_00_model_states.pt", "cpu")  # code in it: refused
    run = states["mtraining"]
    model = build_model(run["model"])
    model.load_state_dict({name.removeprefix("model."): t for name, t in states["module"].items()})
    datasets_offline()
    samples = PackedSequences(tokenize_documents(load_documents(run["data"]), load_tokenizer(run["tokenizer"])),
                              seq_len)
    input_ids = samples[len(samples) - 1][0][None]  # the corpus's tail

    captured = {}

    def capture(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        captured[module.layer_idx] = (query.transpose(1, 2).contiguous(), key.transpose(1, 2).contiguous(), scaling)
        group = query.shape[1] // key.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1), is_causal=True,
            scale=scaling)
        return out.transpose(1, 2), None

    AttentionInterface.register("recall_capture", capture)
    model.set_attn_implementation("recall_capture")
    with torch.no_grad():
        model.model(input_ids=input_ids)
    return [(f"demo {tag} S={seq_len} layer {layer}", q.to(device), k.to(device), scale)
            for layer, (q, k, scale) in sorted(captured.items())]


# ----------------------------------------------------------------------------- evaluation
def evaluate(parts: list[tuple], config: SparseConfig) -> dict:
    """Every method's per-head recall and density on the parts (q/k of one input, heads pooled)."""
    points = {}  # (method, parameter) -> list of (recall [H], density [H]) per part

    def add(method, parameter, result, n):
        points.setdefault((method, parameter), []).append(
            (result.recall[n].flatten(), result.density[n].flatten()))

    for name, q, k, scale in parts:
        b, s, h, _ = q.shape
        nb = -(-s // config.block_size)
        indices = []
        for p in TOP_PS:
            swept = replace(config, p_vertical=p, p_slash=p)
            indices += [("token-diagonal", p, estimate_vertical_slash(q, k, swept, scale)),
                        ("block-pooled", p, block_pooled_index(q, k, swept, scale))]
        default = estimate_vertical_slash(q, k, config, scale)
        indices.append(("default", None, default))
        reference = replace(config, p_vertical=REFERENCE_P, p_slash=REFERENCE_P, max_vertical=REFERENCE_CAP,
                            max_slash_diagonals=REFERENCE_CAP)
        indices.append(("reference", REFERENCE_P, reference_rule_index(q, k, reference, scale)))
        windows = sorted({min(nb, 1 << i) for i in range(nb.bit_length() + 1)})
        indices += [("static", w, static_index(b, h, s, config, w, q.device)) for w in windows]
        indices.append(("static-matched", None, index_for_density(
            lambda n: static_index(b, h, s, config, n + 1, q.device), nb - 1, default.density())))
        started = time.time()
        result = attention_recall(q, k, [i for _, _, i in indices], config.block_size, scale)
        for n, (method, parameter, _) in enumerate(indices):
            add(method, parameter, result, n)
        for n, (method, parameter, _) in enumerate(indices):
            if method in ("token-diagonal", "default"):
                oracle, density = oracle_recall(result.block_mass, s, config.block_size, result.density[n])
                points.setdefault(("oracle" if method != "default" else "oracle-matched", parameter), []).append(
                    (oracle.flatten(), density.flatten()))
        print(f"  {name}: {len(indices)} indices in {time.time() - started:.1f} s", flush=True)
    summary = {}
    for (method, parameter), values in points.items():
        recall = torch.cat([r for r, _ in values])
        density = torch.cat([d for _, d in values])
        summary.setdefault(method, []).append({
            "parameter": parameter, "recall_mean": recall.mean().item(), "recall_min": recall.min().item(),
            "density_mean": density.mean().item(), "recall_per_head": [round(x, 5) for x in recall.tolist()],
            "density_per_head": [round(x, 5) for x in density.tolist()]})
    return summary


def verdict(summary: dict) -> dict:
    """The shipped default against the reference rule: mean recall at least as high, density no
    higher, no head more than HEAD_SLACK below."""
    ours, ref = summary["default"][0], summary["reference"][0]
    gaps = [a - b for a, b in zip(ours["recall_per_head"], ref["recall_per_head"])]
    checks = {"mean_recall_not_lower": ours["recall_mean"] >= ref["recall_mean"] - 1e-9,
              "density_not_higher": ours["density_mean"] <= ref["density_mean"] + 1e-9,
              "worst_head_gap": min(gaps), "worst_head_within_slack": min(gaps) >= -HEAD_SLACK}
    checks["met"] = all(v for key, v in checks.items() if key != "worst_head_gap")
    return checks


def plot(results: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 4), squeeze=False)
    styles = {"token-diagonal": "o-", "block-pooled": "s--", "static": "^:", "oracle": "k.-"}
    for ax, name in zip(axes[0], names):
        summary = results[name]["methods"]
        for method, style in styles.items():
            rows = sorted(summary[method], key=lambda r: r["density_mean"])
            ax.plot([r["density_mean"] for r in rows], [r["recall_mean"] for r in rows], style, label=method,
                    ms=4)
        for method, marker in (("reference", "x"), ("default", "*")):
            row = summary[method][0]
            ax.plot(row["density_mean"], row["recall_mean"], marker, ms=11, label=f"{method} (p 0.9)")
        ax.set_xscale("log")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("density (computed / causal entries)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("recall: kept share of attention mass, all rows")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="*", default=[4096, 8192, 16384],
                        help="planted-pattern sequence lengths (none: skip)")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="a scripts/train_demo.sh save directory whose model's activations to add")
    parser.add_argument("--demo-seq-lens", type=int, nargs="+", default=[1024, 4096],
                        help="token counts of the demo model's captured activations")
    parser.add_argument("--seed", type=int, default=0, help="planted inputs use seed + S")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where q/k, estimators and recall run")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory; None: a fresh ./bench_results/recall-<time>")
    parser.add_argument("--name", default="recall_pareto", help="output file stem")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out or fresh_output_dir("recall")
    out.mkdir(parents=True, exist_ok=True)
    config = SparseConfig()
    inputs = {f"planted S={s}": planted_inputs(s, args.seed + s, args.device) for s in args.seq_lens}
    if args.checkpoint is not None:
        for s in args.demo_seq_lens:
            inputs[f"demo model S={s}"] = demo_inputs(args.checkpoint, s, args.device)
    if not inputs:
        raise SystemExit("nothing to measure: give --seq-lens and/or --checkpoint")
    started = time.time()
    results = {}
    for name, parts in inputs.items():
        print(f"{name}:", flush=True)
        summary = evaluate(parts, config)
        results[name] = {"heads": sum(p[1].shape[0] * p[1].shape[2] for p in parts),
                         "verdict": verdict(summary), "methods": summary}
    print(f"{'input':<22} {'method':<16} {'density':>8} {'recall':>7} {'min head':>8}")
    for name, result in results.items():
        for method in ("default", "reference", "block-pooled", "static-matched", "oracle-matched"):
            row = next(r for r in result["methods"][method] if r["parameter"] in (None, REFERENCE_P))
            print(f"{name:<22} {method:<16} {row['density_mean']:8.4f} {row['recall_mean']:7.4f} "
                  f"{row['recall_min']:8.4f}")
        print(f"{name:<22} verdict: {result['verdict']}")
    record = result_record(
        args.name, params_of(args), [{"input": name, **result} for name, result in results.items()],
        device=(torch.cuda.get_device_name() if args.device.startswith("cuda")
                else f"CPU ({platform.processor() or platform.machine()})"),
        command=command_of("ds_mtraining.bench.recall", sys.argv[1:] if argv is None else argv),
        torch=torch.__version__, config=config.to_dict(), top_ps=list(TOP_PS),
        reference={"p": REFERENCE_P, "caps": REFERENCE_CAP},
        planted={"heads": 8, "kv_heads": 4, "head_dim": 64, "offsets": PLANTED_OFFSETS, "columns": PLANTED_COLUMNS},
        seconds=round(time.time() - started, 1))
    write_json(out / f"{args.name}.json", record)
    plot(results, out / f"{args.name}.png")
    print(f"wrote {out / (args.name + '.json')} and {out / (args.name + '.png')}")
    return 0 if all(r["verdict"]["met"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
