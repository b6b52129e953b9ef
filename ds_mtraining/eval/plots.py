"""PNG figures of the evaluations (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def passkey_heatmap(result: dict, path: Path, title: str = "passkey retrieval"):
    """Accuracy over the depth (rows) x length (columns) grid."""
    plt = _pyplot()
    lengths, depths, accuracy = result["lengths"], result["depths"], result["accuracy"]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.55 * len(depths)))
    image = ax.imshow(accuracy, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i, row in enumerate(accuracy):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="exact-match accuracy")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def loss_curve(result: dict, path: Path, title: str = "loss by position"):
    """Mean token loss per position bucket (drawn as steps over each bucket's range)."""
    plt = _pyplot()
    edges, means = result["edges"], result["mean_loss"]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax.stairs(means, edges, linewidth=1.8)
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("mean token loss (nats)")
    ax.set_xlim(0, edges[-1])
    ax.grid(alpha=0.3)
    ax.set_title(f"{title} ({result['windows']} windows of {result['length']} tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def recall_heatmap(result: dict, path: Path, title: str = "recall of the estimated index"):
    """Recall per layer (rows) and head (columns), with the layer's mean density at the right."""
    plt = _pyplot()
    rows = result["layers"]
    recall = [r["recall"] for r in rows]
    heads = len(recall[0])
    fig, ax = plt.subplots(figsize=(max(6.0, 2.5 + 0.35 * heads), max(3.0, 1.6 + 0.3 * len(rows))))
    image = ax.imshow(recall, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xlabel("query head")
    ax.set_xticks(range(heads), [str(h) for h in range(heads)])
    ax.set_ylabel("layer")
    ax.set_yticks(range(len(rows)), [f"{r['layer']} (d={sum(r['density']) / heads:.2f})" for r in rows])
    fig.colorbar(image, ax=ax, label="recall")
    mean = result["mean"]
    ax.set_title(f"{title}\nmean recall {mean['recall']:.3f} at density {mean['density']:.3f} "
                 f"(static {mean['static_recall']:.3f}, oracle {mean['oracle_recall']:.3f})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
