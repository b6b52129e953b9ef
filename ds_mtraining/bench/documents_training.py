"""``python -m ds_mtraining.bench.documents_training``: the same training with and without
document masking, loss curves side by side.

Two runs of one config through the real launcher path (:mod:`ds_mtraining.train`), the same
seed, initialisation and data order, differing only in ``mtraining.document_masking``. With two
lanes (``--lanes cuda:0 cuda:1``) the runs train at once, one per lane; with one lane, one after
the other. Writes ``documents_<tag>.json`` (per run: loss, density and tokens/s per logged step;
the mean loss over the last ``--tail`` logged steps) and ``documents_<tag>.png``.

    python -m ds_mtraining.bench.documents_training --config ds_configs/documents_32k.json \\
        --steps 300 --lanes cuda:0 cuda:1 --tag 32k_h200
    OMP_NUM_THREADS=1 python -m ds_mtraining.bench.documents_training \\
        --config ds_configs/cpu_demo_documents.json --steps 40 --lanes cpu,cpu --tag cpu_demo
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from ..record import result_record, write_json
from . import fresh_output_dir, params_of
from .launch import launcher_env, read_metric, run_in_lanes, run_logged, training_command

RUNS = {"document_masking": True, "no_document_masking": False}


def train_both(config: dict, steps: int, lanes: list[str], out: Path, seed: int, port: int,
               log_interval: int) -> dict:
    """Trains both runs (lane i takes runs i, i + len(lanes), ...); returns each run's curves."""
    earlier = [name for name in RUNS if (out / name).exists()]
    if earlier:
        raise FileExistsError(f"{out} already holds runs ({', '.join(earlier)}): their metrics would mix; "
                              f"give a new --out or remove it")
    results = {}

    def train(name: str, device: str, lane: int):
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        run_config = json.loads(json.dumps(config))
        run_config["mtraining"]["document_masking"] = RUNS[name]
        write_json(folder / "config.json", run_config)
        began = time.time()
        run_logged(training_command(folder / "config.json", steps, folder / "run", device, port + 10 * lane, seed,
                                    log_interval), folder / "train.log", launcher_env())
        steps_logged, loss = read_metric(folder / "run", "loss")
        results[name] = {"steps": steps_logged.tolist(), "loss": loss.tolist(),
                         "density": read_metric(folder / "run", "density")[1].tolist(),
                         "tokens_per_s": read_metric(folder / "run", "tokens_per_s")[1].tolist(),
                         "device": device, "wall_s": time.time() - began}
        print(f"{name}: trained on {device} in {time.time() - began:.0f} s", flush=True)

    names = list(RUNS)
    run_in_lanes([(names[i::len(lanes)], lanes[i]) for i in range(min(len(lanes), len(names)))], train)
    return results


def plot(results: dict, path: Path, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, color in zip(RUNS, ("tab:blue", "black")):
        run = results["runs"][name]
        ax.plot(run["steps"], run["loss"], color=color, lw=1,
                label=f"{name.replace('_', ' ')} (last {results['tail']}: {results['tail_mean_loss'][name]:.3f})")
    ax.set(xlabel="step", ylabel="training loss (nats/token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ds_mtraining.bench.documents_training",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", required=True, help="DeepSpeed JSON (its document_masking is set per run)")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--lanes", nargs="+", default=["cuda:0"],
                        help="one device string per lane: 'cuda:0', 'cuda:0,cuda:1', 'cpu,cpu' (two CPU ranks)")
    parser.add_argument("--out", default=None, help="folder of the two runs (default: a new bench_results/ folder)")
    parser.add_argument("--results", default=None, help="where documents_<tag>.json/.png go (default: --out)")
    parser.add_argument("--tag", required=True)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--port", type=int, default=29710)
    parser.add_argument("--log_interval", type=int, default=1)
    parser.add_argument("--tail", type=int, default=10, help="logged steps in the closing mean loss")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    config = json.loads(Path(args.config).read_text())
    out = Path(args.out) if args.out else fresh_output_dir("documents_training")
    try:
        runs = train_both(config, args.steps, args.lanes, out, args.seed, args.port, args.log_interval)
    except (OSError, RuntimeError, ValueError) as error:
        print(f"ds_mtraining.bench.documents_training: error: {error}", file=sys.stderr)
        sys.exit(2)
    import torch
    tail_mean = {name: float(np.mean(run["loss"][-args.tail:])) for name, run in runs.items()}
    rows = [{"run": name, "document_masking": RUNS[name], "tail_mean_loss": tail_mean[name]} for name in runs]
    results = result_record("documents_training", params_of(args), rows,
                            device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                            config=config, tail=args.tail, runs=runs, tail_mean_loss=tail_mean,
                            tail_loss_gap=tail_mean["document_masking"] / tail_mean["no_document_masking"] - 1.0)
    out = Path(args.results) if args.results else out
    write_json(out / f"documents_{args.tag}.json", results)
    section = config["mtraining"]
    plot(results, out / f"documents_{args.tag}.png",
         f"{section['seq_len'] // 1024}K tokens, {section.get('attention', 'sparse')}: with / without document masking")
    for name, value in results["tail_mean_loss"].items():
        print(f"{name}: mean loss over the last {args.tail} logged steps {value:.4f}")
    print(f"results: {out / f'documents_{args.tag}.json'}")


if __name__ == "__main__":
    main()
