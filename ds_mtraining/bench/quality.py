"""``python -m ds_mtraining.bench.quality``: does a model trained with MTraining match one
trained with dense attention?

One study trains the same model three times through the real training path
(:mod:`ds_mtraining.train`: same initialisation, same data order, same steps, same seed),
changing only ``mtraining.attention``:

* ``dense``: full causal attention (torch's flash SDPA on one GPU);
* ``sparse``: MTraining's estimated vertical-slash index (the config's budgets);
* ``static``: sinks + a local window at the density MTraining reached (its mean over the last
  tenth of training), the static sparse baseline.

With ``--pretrain_config``, a dense stage 1 (e.g. at a short context, data parallel over all
devices) trains the shared initialisation first and the three runs continue from it, as the
paper continues a pretrained model at a longer context; ``config.json`` of each run and
``pretrain/`` in the study directory record both stages.

Each run is exported to a HF directory and evaluated with dense attention, as the paper
evaluates, by :mod:`ds_mtraining.eval`: held-out loss, loss by position, passkey retrieval over
a depth x length grid, and the recall of MTraining's estimator on the model's own attention.
``compare`` then writes ``quality_<tag>.json`` (held-out loss gaps, passkey gaps, the last
position bucket's gap, MTraining's density over training) and PNGs.

    python -m ds_mtraining.bench.quality run --config ds_configs/quality_32k.json \\
        --data data/quality --steps 1000 --devices cuda:0,cuda:1 --out quality_results/32k
    python -m ds_mtraining.bench.quality compare quality_results/32k --tag 32k

With two devices, dense trains on the first while sparse and then static (which needs sparse's
density) train on the second; with one, the three run one after another. ``--time_budget S``
instead of ``--steps``: dense and sparse first train ``--calibration_steps`` steps each, and the
study takes the largest step count whose runs (measured seconds per step and launch time, plus
``--eval_seconds`` per evaluation) end within S seconds of the start. ``data/quality`` comes
from :mod:`ds_mtraining.eval.corpus` (``train.parquet`` for training, ``heldout.parquet`` for
evaluation: no held-out text is trained on).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

from .launch import launcher_env, read_metric, run_in_lanes, run_logged, training_command
from .provenance import provenance

MODES = ("dense", "sparse", "static")
STATIC_DENSITY_TAIL = 0.1  # static trains at sparse's mean density over this last share of steps


# ----------------------------------------------------------------------------- configs
def mode_config(base: dict, mode: str, steps: int, data_file: str, static_density: float | None = None,
                model: str | None = None) -> dict:
    """The DeepSpeed JSON of one run: ``base`` with this mode, the training data, a learning-rate
    schedule that decays over exactly ``steps`` steps and, if given, a pretrained ``model`` dir."""
    config = json.loads(json.dumps(base))
    section = config["mtraining"]
    section["attention"] = mode
    if model is not None:
        section["model"] = str(model)
    section.pop("static", None)
    if mode == "static":
        if static_density is None:
            raise ValueError("the static run needs MTraining's measured density (train sparse first)")
        section["static"] = {"density": float(static_density), "sink_tokens": section["sparse"].get("sink_tokens", 4)}
    section["data"] = {**section.get("data", {}), "files": [str(Path(data_file).resolve())]}
    section["data"].pop("source", None)
    scheduler = config.get("scheduler", {})
    if scheduler.get("type") == "WarmupDecayLR":
        scheduler["params"]["total_num_steps"] = steps
    return config


def tail_mean(values: np.ndarray, share: float = STATIC_DENSITY_TAIL) -> float:
    """The mean of the last ``share`` of ``values`` (at least one value)."""
    if len(values) == 0:
        raise ValueError("no values logged (is --log_interval larger than --steps?)")
    return float(np.mean(values[-max(1, int(round(share * len(values)))):]))


def budget_candidates(sparse: dict, smallest: int = 16) -> list[dict]:
    """``sparse`` with max_slash_diagonals halved step by step (most generous first)."""
    candidates, cap = [], sparse.get("max_slash_diagonals", 4096)
    while cap >= smallest:
        candidates.append({**sparse, "max_slash_diagonals": cap})
        cap //= 2
    return candidates


def choose_budget(model_dir: str, config: dict, data_file: str, target: float, device: str) -> dict:
    """The most generous slash budget (:func:`budget_candidates` of the config's ``sparse``) whose
    index, estimated on the model's own q/k over ``seq_len`` tokens of ``data_file``, has a mean
    density <= ``target``: the budget that keeps a study inside its density limit."""
    import torch
    from ..config import SparseConfig
    from ..data import load_tokenizer
    from ..eval.model_recall import index_densities
    from ..eval.runtime import data_spec, heldout_stream, load_model
    section = config["mtraining"]
    candidates = budget_candidates({"block_size": section.get("stripe_block", 128), **section["sparse"]})
    model = load_model(model_dir, torch.device(device), torch.bfloat16 if device.startswith("cuda") else torch.float32)
    ids = heldout_stream(data_spec(data_file), load_tokenizer(section.get("tokenizer", "bytes")), section["seq_len"])
    densities = index_densities(model, ids[:section["seq_len"]], [SparseConfig.from_dict(c) for c in candidates])
    fitting = [i for i, d in enumerate(densities) if d <= target]
    if not fitting:
        raise RuntimeError(f"no slash budget down to max_slash_diagonals={candidates[-1]['max_slash_diagonals']} "
                           f"reaches density {target} (densities {densities}); lower p_slash/max_vertical "
                           f"or lengthen seq_len")
    chosen = fitting[0]
    return {"target": target, "seq_len": section["seq_len"], "chosen": candidates[chosen],
            "density": densities[chosen],
            "candidates": [{"max_slash_diagonals": c["max_slash_diagonals"], "density": d}
                           for c, d in zip(candidates, densities)]}


# ----------------------------------------------------------------------------- runs
class Study:
    """Runs the three trainings and evaluations of one study directory."""

    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.base = json.loads(Path(args.config).read_text())
        if args.passkey_questions is not None:
            self.base["mtraining"].setdefault("data", {})["passkey_questions"] = args.passkey_questions
        self.data = Path(args.data)
        for name in ("train.parquet", "heldout.parquet"):
            if not (self.data / name).is_file():
                raise FileNotFoundError(f"{self.data / name} is missing; build the corpus with "
                                        f"python -m ds_mtraining.eval.corpus --out {self.data} ...")
        earlier = [name for name in ("pretrain", "calibration", *MODES) if (self.out / name).exists()]
        if earlier:
            raise FileExistsError(f"{self.out} already holds a study ({', '.join(earlier)}): its runs would "
                                  f"append to those metrics; give a new --out or remove it")
        self.out.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.start = time.time()
        self.pretrained = None
        self.static_density = None  # from the budget choice, else sparse's measured density

    def say(self, message: str):
        with self.lock:
            print(f"[{time.time() - self.start:7.1f} s] {message}", flush=True)

    @staticmethod
    def _device_env(device: str) -> dict:
        """The environment of a one-process command (evaluation, budget) on ``device``."""
        env = dict(os.environ)
        if device.startswith("cuda:"):
            env["CUDA_VISIBLE_DEVICES"] = device.split(":")[1]
        return env

    def train(self, mode: str, folder: Path, steps: int, device: str, port: int, export: bool,
              static_density: float | None = None, base: dict | None = None) -> float:
        """Trains one run into ``folder`` (``device``: one, or comma-separated for data parallel);
        returns its wall time (launch included)."""
        folder.mkdir(parents=True, exist_ok=True)
        config = mode_config(base or self.base, mode, steps, str(self.data / "train.parquet"), static_density,
                             None if base else self.pretrained)
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        command = training_command(folder / "config.json", steps, folder / "run", device, port, self.args.seed,
                                   self.args.log_interval, folder / "hf" if export else None)
        began = time.time()
        run_logged(command, folder / "train.log", launcher_env())
        return time.time() - began

    def calibrate(self, lanes) -> int:
        """Trains dense and sparse briefly (concurrently when there are two lanes) and returns the
        largest step count that fits the time budget."""
        args, measured = self.args, {}

        def measure(mode, device, port):
            folder = self.out / "calibration" / mode
            wall = self.train(mode, folder, args.calibration_steps, device, port, export=False)
            seq_len = self.base["mtraining"]["seq_len"]
            per_step = float(np.median(seq_len / read_metric(folder / "run", "tokens_per_s")[1]))
            measured[mode] = {"step_s": per_step, "launch_s": max(0.0, wall - args.calibration_steps * per_step)}

        self.say(f"calibrating: {args.calibration_steps} steps of dense and sparse")
        self._in_lanes([(["dense"], lanes[0][1]), (["sparse"], lanes[-1][1])] if len(lanes) > 1 else
                       [(["dense", "sparse"], lanes[0][1])], measure)
        left = args.time_budget - (time.time() - self.start) - 30  # the comparison and plots
        static = measured["sparse"]  # same kernels and shapes as sparse, no estimation: at most as slow
        costs = {"dense": measured["dense"], "sparse": measured["sparse"], "static": static}
        steps = min(int((left - sum(costs[m]["launch_s"] + args.eval_seconds for m in modes))
                        / sum(costs[m]["step_s"] for m in modes)) for modes, _ in lanes)
        (self.out / "calibration.json").write_text(json.dumps({"measured": measured, "steps": steps,
                                                                "time_left_s": left}, indent=2))
        rates = ", ".join(f"{mode} {value['step_s']:.3f} s/step" for mode, value in measured.items())
        self.say(f"calibrated: {rates} -> {steps} steps")
        if steps < args.calibration_steps:
            raise RuntimeError(f"--time_budget {args.time_budget} s leaves room for only {steps} steps; "
                               f"give more time or a smaller model/sequence")
        return steps

    def pretrain(self, devices: str):
        """Stage 1: dense training of the shared initialisation (data parallel over ``devices``);
        every study run continues from its export."""
        args, folder = self.args, self.out / "pretrain"
        base = json.loads(Path(args.pretrain_config).read_text())
        self.say(f"pretraining (dense, {args.pretrain_steps} steps of {args.pretrain_config}) on {devices}")
        wall = self.train("dense", folder, args.pretrain_steps, devices, args.port + 50, export=True, base=base)
        self.pretrained = str((folder / "hf").resolve())
        self.say(f"pretrained in {wall:.0f} s -> {self.pretrained}")

    def choose_budget(self, device: str):
        """Sets the study's slash budget to the most generous one whose density on the starting
        model is <= --density_target (:func:`choose_budget`); static trains at that density."""
        args = self.args
        model = self.pretrained
        if model is None:
            raise ValueError("--density_target needs a trained starting model (--pretrain_config)")
        self.say(f"choosing the slash budget for density <= {args.density_target}")
        out = self.out / "budget.json"
        command = [sys.executable, "-m", "ds_mtraining.bench.quality", "budget", model, "--config", args.config,
                   "--data", str(self.data / "train.parquet"), "--target", str(args.density_target),
                   "--device", "cuda" if device.startswith("cuda") else "cpu", "--out", str(out)]
        run_logged(command, self.out / "budget.log", self._device_env(device))
        choice = json.loads(out.read_text())
        self.base["mtraining"]["sparse"] = {k: v for k, v in choice["chosen"].items() if k != "block_size"}
        self.static_density = choice["density"]
        self.say(f"slash budget: max_slash_diagonals={choice['chosen']['max_slash_diagonals']} "
                 f"(density {choice['density']:.4f} on the starting model)")

    def _in_lanes(self, lanes, work):
        """:func:`run_in_lanes` with ``work(mode, device, port)``: each lane its own ports."""
        run_in_lanes(lanes, lambda mode, device, lane: work(mode, device, self.args.port + 10 * lane))

    def run_mode(self, mode: str, device: str, port: int):
        args, folder = self.args, self.out / mode
        density = None
        if mode == "static":
            density = self.static_density or tail_mean(read_metric(self.out / "sparse" / "run", "density")[1])
        self.say(f"{mode}: training {args.steps} steps on {device}" +
                 (f" (static density {density:.4f})" if density is not None else ""))
        trained = self.train(mode, folder, args.steps, device, port, export=True, static_density=density)
        config = json.loads((folder / "config.json").read_text())
        began = time.time()
        self.say(f"{mode}: trained in {trained:.0f} s; evaluating")
        evaluate = [sys.executable, "-m", "ds_mtraining.eval", str(folder / "hf"), "--out", str(folder / "eval"),
                    "--data", str(self.data / "heldout.parquet"), "--lengths", args.passkey_lengths,
                    "--depths", args.passkey_depths, "--trials", str(args.passkey_trials),
                    "--loss_length", str(config["mtraining"]["seq_len"]), "--loss_windows", str(args.loss_windows),
                    "--recall_length", str(args.recall_length), "--sparse_config",
                    json.dumps(config["mtraining"]["sparse"]), "--device", "cuda" if device != "cpu" else "cpu",
                    "--seed", str(args.seed), "--no_progress"]
        run_logged(evaluate, folder / "eval.log", self._device_env(device))
        (folder / "timing.json").write_text(json.dumps({"train_s": trained, "eval_s": time.time() - began,
                                                        "device": device}))
        self.say(f"{mode}: done")

    def run(self):
        devices = self.args.devices.split(",")
        if len(devices) >= 2:
            lanes = [(["dense"], devices[0]), (["sparse", "static"], devices[1])]
        else:
            lanes = [(["sparse", "static", "dense"], devices[0])]
        if self.args.pretrain_config:
            self.pretrain(",".join(devices))
        if self.args.density_target:
            self.choose_budget(devices[0])
            if len(devices) >= 2:  # static knows its density now: it trains beside sparse
                lanes = [(["dense"], devices[0]), (["sparse"], devices[1]), (["static"], devices[1])]
        if self.args.steps is None:
            self.args.steps = self.calibrate(lanes)
        self._in_lanes(lanes, self.run_mode)


# ----------------------------------------------------------------------------- comparison
def _eval_file(folder: Path, name: str) -> dict:
    return json.loads((folder / "eval" / f"{name}.json").read_text())


def mode_results(folder: Path) -> dict:
    """One run's training curve, density and evaluation results."""
    run = folder / "run"
    steps, loss = read_metric(run, "loss")
    _, density = read_metric(run, "density")
    _, speed = read_metric(run, "tokens_per_s")
    position = _eval_file(folder, "loss_by_position")
    passkey = _eval_file(folder, "passkey")
    result = {"train_steps": steps.tolist(), "train_loss": loss.tolist(), "density": density.tolist(),
              "final_density": tail_mean(density), "tokens_per_s": float(np.median(speed)),
              "heldout_loss": position["overall"], "heldout_tokens": int(sum(position["tokens"])),
              "loss_by_position": {"edges": position["edges"], "mean_loss": position["mean_loss"]},
              "last_bucket_loss": position["mean_loss"][-1],
              "passkey_accuracy": float(np.mean(passkey["accuracy"])),
              "passkey": {k: passkey[k] for k in ("lengths", "depths", "accuracy")},
              "config": json.loads((folder / "config.json").read_text())["mtraining"]}
    recall = folder / "eval" / "recall.json"
    if recall.is_file():
        result["recall"] = json.loads(recall.read_text())["mean"]
    timing = folder / "timing.json"
    if timing.is_file():
        result["timing"] = json.loads(timing.read_text())
    return result


def gaps(mode: dict, dense: dict) -> dict:
    """``mode`` against dense: relative loss gaps (positive: worse than dense) and the passkey
    accuracy difference in points (positive: better than dense)."""
    return {"heldout_loss_gap": mode["heldout_loss"] / dense["heldout_loss"] - 1.0,
            "last_bucket_loss_gap": mode["last_bucket_loss"] / dense["last_bucket_loss"] - 1.0,
            "passkey_gap_points": 100.0 * (mode["passkey_accuracy"] - dense["passkey_accuracy"])}


def verdict(results: dict) -> dict:
    """The study's questions, each answered from the numbers."""
    sparse, static, dense = (results["modes"][m] for m in ("sparse", "static", "dense"))
    vs_sparse, vs_static = results["sparse_vs_dense"], results["static_vs_dense"]
    return {
        "sparse_final_density_le_0.15": sparse["final_density"] <= 0.15,
        "sparse_heldout_loss_within_1pct_of_dense": abs(vs_sparse["heldout_loss_gap"]) <= 0.01
                                                    or vs_sparse["heldout_loss_gap"] < 0,
        "static_worse_than_dense_1pct_loss_or_10pt_passkey": vs_static["heldout_loss_gap"] >= 0.01
                                                             or vs_static["passkey_gap_points"] <= -10,
        "dense_passkey_ge_80pct": dense["passkey_accuracy"] >= 0.8,
        "sparse_passkey_ge_dense_minus_2pt": vs_sparse["passkey_gap_points"] >= -2,
        "sparse_last_bucket_within_2pct_of_dense": vs_sparse["last_bucket_loss_gap"] <= 0.02,
    }


def compare(study: Path) -> dict:
    results = {"modes": {m: mode_results(study / m) for m in MODES}}
    dense = results["modes"]["dense"]
    for mode in ("sparse", "static"):
        results[f"{mode}_vs_dense"] = gaps(results["modes"][mode], dense)
    results["verdict"] = verdict(results)
    if (study / "budget.json").is_file():
        results["budget"] = json.loads((study / "budget.json").read_text())
    if (study / "pretrain" / "config.json").is_file():
        steps, loss = read_metric(study / "pretrain" / "run", "loss")
        results["pretrain"] = {"config": json.loads((study / "pretrain" / "config.json").read_text())["mtraining"],
                               "steps": int(steps[-1]), "train_loss": loss.tolist()}
    return results


def plot(results: dict, out: Path, tag: str) -> list[str]:
    """Training loss, MTraining's density, loss by position and the passkey grids of the three runs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {"dense": "black", "sparse": "tab:blue", "static": "tab:orange"}
    modes = results["modes"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for mode, r in modes.items():
        axes[0].plot(r["train_steps"], r["train_loss"], color=colors[mode], label=mode, lw=1)
        edges = np.array(r["loss_by_position"]["edges"])
        axes[2].plot((edges[:-1] + edges[1:]) / 2, r["loss_by_position"]["mean_loss"], "o-", color=colors[mode],
                     label=f"{mode} ({r['heldout_loss']:.4f})", ms=3)
    axes[0].set(xlabel="step", ylabel="training loss (nats/token)", title="training loss")
    axes[0].set_ylim(top=min(max(modes["dense"]["train_loss"]), 2 * min(modes["dense"]["train_loss"]) + 1))
    for mode in ("sparse", "static"):
        axes[1].plot(modes[mode]["train_steps"], modes[mode]["density"], color=colors[mode], label=mode)
    axes[1].axhline(0.15, color="gray", ls="--", lw=0.8, label="15%")
    axes[1].set(xlabel="step", ylabel="computed / causal entries", title="attention density in training")
    axes[2].set(xlabel="position (tokens)", ylabel="held-out loss", title="held-out loss by position")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    curves = out / f"quality_{tag}_curves.png"
    fig.savefig(curves, dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8), constrained_layout=True)
    for ax, (mode, r) in zip(axes, modes.items()):
        grid = np.array(r["passkey"]["accuracy"])
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(r["passkey"]["lengths"])), [str(n) for n in r["passkey"]["lengths"]])
        ax.set_yticks(range(len(r["passkey"]["depths"])), [f"{d:.2f}" for d in r["passkey"]["depths"]])
        ax.set(xlabel="prompt length (tokens)", ylabel="needle depth" if ax is axes[0] else None,
               title=f"{mode}: passkey {100 * r['passkey_accuracy']:.0f}%")
        for (i, j), value in np.ndenumerate(grid):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7)
    fig.colorbar(image, ax=axes, shrink=0.8)
    passkey = out / f"quality_{tag}_passkey.png"
    fig.savefig(passkey, dpi=110)
    plt.close(fig)
    return [curves.name, passkey.name]


# ----------------------------------------------------------------------------- command line
def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ds_mtraining.bench.quality",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train, export and evaluate dense, sparse and static, then compare",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    run.add_argument("--config", required=True, help="base DeepSpeed JSON (its mtraining.attention is replaced)")
    run.add_argument("--data", required=True, help="corpus folder with train.parquet and heldout.parquet")
    length = run.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=int, help="optimizer steps of every run")
    length.add_argument("--time_budget", type=float, help="seconds for the whole study: calibrate the steps")
    run.add_argument("--calibration_steps", type=int, default=20, help="steps of each calibration run")
    run.add_argument("--eval_seconds", type=float, default=45, help="time allowed per evaluation (calibration)")
    run.add_argument("--pretrain_config", default=None,
                     help="stage 1: a DeepSpeed JSON trained densely (data parallel over --devices) before the "
                          "study; every run continues from it (the paper's setting: context extension)")
    run.add_argument("--pretrain_steps", type=int, default=0, help="steps of stage 1")
    run.add_argument("--density_target", type=float, default=None,
                     help="choose the slash budget whose density on the stage-1 model is <= this; static "
                          "then trains at that density, beside sparse")
    run.add_argument("--passkey_questions", type=int, default=None,
                     help="times each passkey sample of the study's runs asks its key (stage 1 keeps its "
                          "config's); 1 puts the only retrieval at the end, where MTraining's estimator looks. "
                          "Default: --config's mtraining.data.passkey_questions")
    budget = sub.add_parser("budget", help="the slash budget of a config that keeps a model's density <= target",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    budget.add_argument("model", help="HF model directory")
    budget.add_argument("--config", required=True, help="DeepSpeed JSON: its mtraining.sparse, seq_len, tokenizer")
    budget.add_argument("--data", required=True, help="text file (parquet/jsonl) to estimate on")
    budget.add_argument("--target", type=float, required=True, help="largest mean density")
    budget.add_argument("--device", default="cuda")
    budget.add_argument("--out", required=True, help="JSON file for the choice")
    run.add_argument("--devices", default="cuda:0,cuda:1", help="'cuda:0,cuda:1', 'cuda:0' or 'cpu'")
    run.add_argument("--out", required=True, help="study directory (one folder per mode)")
    run.add_argument("--seed", type=int, default=1234, help="initialisation and data order of every run")
    run.add_argument("--log_interval", type=int, default=10, help="steps between logged metrics")
    run.add_argument("--port", type=int, default=29610, help="first master port (lanes add 10)")
    run.add_argument("--passkey_lengths", default="4096,8192,16384,32768")
    run.add_argument("--passkey_depths", default="0,0.25,0.5,0.75,1")
    run.add_argument("--passkey_trials", type=int, default=4)
    run.add_argument("--loss_windows", type=int, default=8, help="held-out windows of seq_len tokens")
    run.add_argument("--recall_length", type=int, default=16384)
    run.add_argument("--tag", default=None, help="results name: quality_<tag>.json (default: the out folder's name)")
    run.add_argument("--results", default=None, help="where quality_<tag>.json and PNGs go (default: --out)")
    cmp = sub.add_parser("compare", help="write quality_<tag>.json and PNGs from a study directory",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    cmp.add_argument("study", help="the study directory of a run")
    cmp.add_argument("--tag", default=None, help="default: the study folder's name")
    cmp.add_argument("--results", default=None, help="where quality_<tag>.json and PNGs go (default: the study)")
    args = parser.parse_args(argv)
    if args.command == "budget":
        try:
            choice = choose_budget(args.model, json.loads(Path(args.config).read_text()), args.data, args.target,
                                   args.device)
        except (FileNotFoundError, RuntimeError, ValueError) as error:
            print(f"ds_mtraining.bench.quality: error: {error}", file=sys.stderr)
            sys.exit(2)
        Path(args.out).write_text(json.dumps(choice, indent=2))
        print(json.dumps(choice, indent=2))
        return
    if args.command == "run":
        if (args.steps or 1) < 1 or args.calibration_steps < 2:
            parser.error("--steps must be >= 1 and --calibration_steps >= 2")
        if bool(args.pretrain_config) != (args.pretrain_steps > 0):
            parser.error("--pretrain_config and --pretrain_steps >= 1 go together")
        try:
            Study(args).run()
        except (FileNotFoundError, FileExistsError, RuntimeError, ValueError) as error:
            print(f"ds_mtraining.bench.quality: error: {error}", file=sys.stderr)
            sys.exit(2)
        study = Path(args.out)
    else:
        study = Path(args.study)
    tag = args.tag or study.name
    results = compare(study)
    results.update(date=time.strftime("%Y-%m-%d"), **provenance(),
                   command=" ".join(["python -m ds_mtraining.bench.quality"] + sys.argv[1:]), device=_device_name(),
                   study=str(study))
    out = Path(args.results) if args.results else study
    out.mkdir(parents=True, exist_ok=True)
    results["plots"] = plot(results, out, tag)
    (out / f"quality_{tag}.json").write_text(json.dumps(results, indent=1))
    for mode in ("sparse", "static"):
        g = results[f"{mode}_vs_dense"]
        print(f"{mode} vs dense: held-out loss {100 * g['heldout_loss_gap']:+.2f}%, last bucket "
              f"{100 * g['last_bucket_loss_gap']:+.2f}%, passkey {g['passkey_gap_points']:+.1f} points")
    for question, answer in results["verdict"].items():
        print(f"  {'yes' if answer else 'NO '}  {question}")
    print(f"results: {out / f'quality_{tag}.json'}")


def _device_name() -> str:
    import torch
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
