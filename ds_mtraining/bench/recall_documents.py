"""Recall with document masking on packed real text against the same documents run one by one.

    python -m ds_mtraining.bench.recall_documents [--out OUT]

Documents: the standard library's ``.py`` files (one file per document), byte tokens, each cut to
a length drawn log-uniformly in ``[--shortest, --longest]`` (files shorter than the draw keep
their length) and packed into one sequence of ``--seq-len`` tokens (the last one cut to fit).
q/k: every attention layer of a tiny Qwen2 (``tiny-qwen2``) trained ``--train-steps`` steps here
on other standard-library files, run on each document alone; the packed q/k are those
concatenated, which is exactly the document-masked packed forward (positions restart per
document, no attention across documents).

Measured (recall: kept share of the exact attention mass over all rows; density: computed over
attended entries, both with the document mask; means over layers and heads):

* ``packed, documents (<weight>)``: :func:`~ds_mtraining.estimator.rule.estimate_vertical_slash` with
  ``doc_start`` on the packed sequence, for each document weight of
  :data:`~ds_mtraining.estimator.rule.DOCUMENT_WEIGHTS` (``tokens`` is the shipped rule);
* ``packed, last queries only``: the estimator without ``doc_start`` (only the sequence's last
  queries, which see only the last document), measured with the document mask;
* ``alone``: each document estimated and measured as its own sequence, same budgets; recall
  weighted by tokens (each row counts once, as in the packed recall) and density over all
  documents' causal entries (as the packed density), plus the plain means over documents.

Each at top-p ``--top-ps`` (p_vertical = p_slash, default caps). The check, per top-p:
packed recall with documents (the shipped weight) >= alone recall (token-weighted).
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..config import SparseConfig
from ..data import ByteTokenizer, stdlib_documents
from ..documents import doc_start_from_cu_seqlens
from ..estimator.rule import (DOCUMENT_WEIGHTS, document_column_and_diagonal_mass, estimate_vertical_slash,
                        index_from_masses)
from ..recall import attention_recall
from ..record import result_record, write_json
from . import command_of, fresh_output_dir, params_of

CHOSEN_WEIGHT = "tokens"  # the rule estimate_vertical_slash ships


# ----------------------------------------------------------------------------- inputs
def file_documents(count: int, skip: int) -> list[np.ndarray]:
    """Byte tokens (plus the end-of-document token) of ``count`` standard-library files after the
    first ``skip``, one file per document."""
    texts = [d["text"] for d in stdlib_documents(document_chars=1, max_documents=skip + count)[skip:]]
    tokenizer = ByteTokenizer()
    return [np.append(tokenizer.encode(t), tokenizer.eos_token_id) for t in texts]


def packed_documents(seq_len: int, shortest: int, longest: int, seed: int, skip: int) -> list[np.ndarray]:
    """Documents of log-uniform lengths (at most their file's) filling exactly ``seq_len`` tokens."""
    rng = np.random.default_rng(seed)
    documents, used = [], 0
    for tokens in file_documents(4 * seq_len // shortest, skip):
        length = min(len(tokens), int(np.exp(rng.uniform(np.log(shortest), np.log(longest)))), seq_len - used)
        documents.append(tokens[:length])
        used += length
        if used == seq_len:
            return documents
    raise RuntimeError(f"the standard library has too few files to fill {seq_len} tokens")


def trained_model(steps: int, seed: int, window: int = 512, batch: int = 8):
    """``tiny-qwen2`` trained ``steps`` AdamW steps on random windows of the first 200 files."""
    from ..training.model import build_model
    torch.manual_seed(seed)
    model = build_model({"name_or_path": "tiny-qwen2", "config_overrides": {}})
    stream = torch.from_numpy(np.concatenate(file_documents(200, 0))).long()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - window, (batch,), generator=generator)
        ids = torch.stack([stream[s:s + window] for s in starts.tolist()])
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"trained tiny-qwen2 {steps} steps, last loss {loss.item():.3f}", flush=True)
    return model.eval(), loss.item()


@torch.no_grad()
def layer_qk(model, documents: list[np.ndarray]) -> list[tuple]:
    """Per layer (q [1, S, H, D], k [1, S, Hkv, D], scale): each document's own forward, concatenated."""
    from ..eval.model_recall import capturing
    per_layer = {}

    def hook(module, q, k, scale):
        per_layer.setdefault(module.layer_idx, []).append((q.float(), k.float(), scale))

    with capturing(model, hook):
        for tokens in documents:
            model.base_model(input_ids=torch.from_numpy(tokens).long()[None])
    return [(torch.cat([q for q, _, _ in parts], 1), torch.cat([k for _, k, _ in parts], 1), parts[0][2])
            for _, parts in sorted(per_layer.items())]


# ----------------------------------------------------------------------------- measurement
def budgets(block_size: int, top_ps) -> dict:
    """One config per top-p (vertical and slash alike), default caps."""
    return {p: SparseConfig(block_size=block_size, p_vertical=p, p_slash=p) for p in top_ps}


def mean_rows(sums: dict) -> dict:
    return {name: {key: float(torch.cat(v).mean()) for key, v in row.items()} for name, row in sums.items()}


def packed_rows(layers, doc_start, configs: dict) -> dict:
    """Mean recall/density over layers and heads of each packed estimator and top-p, document-masked."""
    sums = {}
    last_q, block = next(iter(configs.values())).last_q, next(iter(configs.values())).block_size
    for q, k, scale in layers:
        methods = {}
        for weight in DOCUMENT_WEIGHTS:
            masses = document_column_and_diagonal_mass(q, k, doc_start, last_q, scale, weight)
            methods.update({(f"packed, documents ({weight})", p): index_from_masses(*masses, config, doc_start)
                            for p, config in configs.items()})
        methods.update({("packed, last queries only", p): estimate_vertical_slash(q, k, config, scale)
                        for p, config in configs.items()})
        result = attention_recall(q, k, list(methods.values()), block, scale, doc_start=doc_start)
        for n, name in enumerate(methods):
            row = sums.setdefault(name, {"recall": [], "density": []})
            row["recall"].append(result.recall[n].flatten())
            row["density"].append(result.density[n].flatten())
    return mean_rows(sums)


def alone_rows(layers, lengths: list[int], configs: dict) -> dict:
    """Each document estimated and measured alone: token-weighted recall and entry-weighted density
    (the packed measures' weighting) and the plain means over documents."""
    n = torch.tensor(lengths, dtype=torch.float64)
    entries = n * (n + 1) / 2
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    block = next(iter(configs.values())).block_size
    recall = torch.zeros(len(configs), len(layers), len(lengths), dtype=torch.float64)
    density = torch.zeros_like(recall)
    for layer, (q, k, scale) in enumerate(layers):
        for d, (begin, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            qd, kd = q[:, begin:end], k[:, begin:end]
            indices = [estimate_vertical_slash(qd, kd, config, scale) for config in configs.values()]
            result = attention_recall(qd, kd, indices, block, scale)
            recall[:, layer, d] = result.recall.flatten(1).mean(-1)
            density[:, layer, d] = result.density.flatten(1).mean(-1)
    rows = {}
    for i, p in enumerate(configs):
        rows[("alone (token-weighted, as packed)", p)] = {
            "recall": float((recall[i] @ n / n.sum()).mean()), "density": float((density[i] @ entries / entries.sum()).mean())}
        rows[("alone (mean over documents)", p)] = {"recall": float(recall[i].mean()), "density": float(density[i].mean())}
    return rows


def plot(rows: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(name for name, _ in rows):
        points = sorted((rows[(m, p)]["density"], rows[(m, p)]["recall"]) for m, p in rows if m == method)
        ax.plot(*zip(*points), "*-" if CHOSEN_WEIGHT in method else "o--", ms=8, label=method)
    ax.set_xlabel("density (computed / document-masked causal entries)")
    ax.set_ylabel("recall (kept share of attention mass, all rows)")
    ax.set_title("top-p sweep, packed vs documents alone", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=8192, help="packed sequence length")
    parser.add_argument("--shortest", type=int, default=8, help="shortest drawn document length (tokens)")
    parser.add_argument("--longest", type=int, default=2048, help="longest drawn document length (tokens)")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--train-steps", type=int, default=200, help="steps of the tiny model's training")
    parser.add_argument("--top-ps", type=float, nargs="+", default=[0.5, 0.7, 0.9],
                        help="top-p budgets swept (p_vertical = p_slash)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: a new bench_results/ one)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    configs = budgets(args.block_size, args.top_ps)
    documents = packed_documents(args.seq_len, args.shortest, args.longest, args.seed, skip=200)
    lengths = [len(d) for d in documents]
    model, loss = trained_model(args.train_steps, args.seed)
    layers = layer_qk(model, documents)
    doc_start = doc_start_from_cu_seqlens(torch.tensor([0, *lengths]).cumsum(0), args.seq_len)
    rows = {**packed_rows(layers, doc_start, configs), **alone_rows(layers, lengths, configs)}
    print(f"S={args.seq_len}, {len(lengths)} documents of {min(lengths)}..{max(lengths)} tokens "
          f"(median {int(np.median(lengths))}), block {args.block_size}, {len(layers)} layers x "
          f"{layers[0][0].shape[2]} heads")
    print(f"{'method':<36} {'top-p':>5} {'recall':>7} {'density':>8}")
    for (name, p), row in sorted(rows.items(), key=lambda item: (item[0][1], item[0][0])):
        print(f"{name:<36} {p:5.2f} {row['recall']:7.4f} {row['density']:8.4f}")
    check = {p: {"packed_recall": rows[(f"packed, documents ({CHOSEN_WEIGHT})", p)]["recall"],
                 "alone_recall": rows[("alone (token-weighted, as packed)", p)]["recall"]} for p in configs}
    for p, c in check.items():
        c["met"] = c["packed_recall"] >= c["alone_recall"]
        print(f"top-p {p}: packed recall with documents {c['packed_recall']:.4f} "
              f"{'>=' if c['met'] else '<'} alone {c['alone_recall']:.4f}: {'met' if c['met'] else 'NOT met'}")
    met = all(c["met"] for c in check.values())
    args.out = args.out or fresh_output_dir("recall_documents")
    record = result_record(
        "recall_documents", params_of(args), [{"method": m, "top_p": p, **row} for (m, p), row in rows.items()],
        command=command_of("ds_mtraining.bench.recall_documents", sys.argv[1:] if argv is None else argv),
        device=f"CPU ({platform.processor() or platform.machine()})", torch=torch.__version__,
        configs={str(p): c.to_dict() for p, c in configs.items()}, chosen_weight=CHOSEN_WEIGHT,
        model={"preset": "tiny-qwen2", "train_steps": args.train_steps, "final_loss": loss},
        seq_len=args.seq_len, document_lengths=lengths, check={str(p): c for p, c in check.items()}, met=met,
        seconds=round(time.time() - started, 1))
    write_json(args.out / "recall_documents.json", record)
    plot(rows, args.out / "recall_documents.png")
    print(f"wrote {args.out / 'recall_documents.json'} and {args.out / 'recall_documents.png'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
