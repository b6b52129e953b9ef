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

``long`` is the long-context study (:class:`LongStudy`, one GPU, ``scripts/quality_128k.sh``):
dense stages at 4K and 32K, the slash budget, then dense (FlashAttention-4), MTraining and static
arms continued to 128K from the 32K export on one token stream, evaluated at 32K/64K/128K (loss by
position, the RULER-style tasks of :mod:`ds_mtraining.ruler` with Wilson intervals, each layer's
density; the MTraining arm with sparse and with dense attention), compared against the goals. Its
stages run per call and resume in one folder (``study.json``); docs/BENCHMARKS.md has the commands.

    python -m ds_mtraining.bench.quality long --out /tmp/quality_128k --data data/quality \
        --device cuda:0 --time_budget 560 --results OUT
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..distributed.spawn import free_port
from ..record import plot_path, result_path, write_json, write_result
from ..ruler import TASKS as RULER_TASKS
from .launch import launcher_env, metric_path, read_metric, run_in_lanes, run_logged, training_command
from .model_pack import MANIFEST, pack_model, unpack_model

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
        write_json(folder / "config.json", config)
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
        write_json(self.out / "calibration.json", {"measured": measured, "steps": steps, "time_left_s": left})
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
        write_json(folder / "timing.json", {"train_s": trained, "eval_s": time.time() - began, "device": device})
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


# ----------------------------------------------------------------------------- the long-context study
# Issue 52: dense stages at a short and a middle length, then dense (FA4 on Hopper), MTraining and
# static arms continued to 128K from the last one's export on the same token stream; evaluation at
# several lengths.
LONG_STAGES = ("pretrain", "extend", "probe", "budget", "dense", "sparse", "static", "eval", "compare")
LONG_EVALS = ("dense:dense", "sparse:sparse", "sparse:dense", "static:static")  # static served as it trained
# A study's settings, fixed by its first call (study.json). The dense stages are the 32K study's
# recipe, the one whose model retrieved: 1000 steps at 4K on passkey samples asking 8 times each,
# then 900 at 32K on passkey samples asking once (quality_32k.json), where retrieval is learned (its
# 4K model solves none yet; 900 steps at 32K asking 8 times, after a 4K stage of the four tasks,
# taught none either: docs/RESULTS.md). By the measured stages the defaults need about 13 minutes
# of one H100 for the dense stages and 20 for the arms and their evaluations (docs/BENCHMARKS.md).
# The arms' models do not come back from the machine; the start model does, as a pack (START_PACK,
# scripts/quality_model.sh), so a study spans two stays: dense stages, then the arms.
LONG_DEFAULTS = {
    "config": "ds_configs/quality_128k.json", "pretrain_config": "ds_configs/quality_pretrain_4k.json",
    "extend_config": "ds_configs/quality_32k.json", "pretrain_steps": 1000, "extend_len": 32768,
    "extend_steps": 900, "dense_stage_questions": 8, "extend_questions": 1,
    "probe_trials": 24, "steps": 100, "seed": 1234, "log_interval": 5, "save_interval": 200,
    "profile_step": 8, "density_target": 0.08, "eval_lengths": [32768, 65536, 131072],
    "depths": [0.0, 0.25, 0.5, 0.75, 1.0], "ruler_tasks": list(RULER_TASKS), "trials": 4,
    "target_width": 0.04, "max_trials": 24, "loss_windows": 4, "buckets": 16, "evals": list(LONG_EVALS),
    "dense_kernel": "auto",
}
GOALS = {"heldout_loss_gap": 0.01, "last_bucket_loss_gap": 0.02, "accuracy_points": 2.0, "density": 0.10,
         "interval_width": 0.04}
PREEMPTED = (128 + signal.SIGTERM, 128 + signal.SIGUSR1)  # the run saved the step in flight and stopped
STOP_GRACE_S = 180  # after SIGTERM at the deadline: the step in flight and its checkpoint
RESERVE_S = 30  # of a call's --time_budget, kept for the comparison and the output's archive
START_PACK = "start_pack"  # the study's folder holding the start model as a pack (bench.model_pack)
# the arms train only from a start model whose probe solves at least this share of each task its dense
# stages trained (--min_start_accuracy): a model that retrieves nothing makes every task comparison empty
DEFAULT_MIN_START_ACCURACY = 0.5


class StageIncomplete(RuntimeError):
    """A stage stopped at the call's deadline with its progress saved: the next call continues it."""


@dataclass
class TrainingLaunch:
    """One training launch of the long study: ``config`` (a DeepSpeed JSON file) for ``steps``
    steps into ``save_dir``, resumed from its latest checkpoint with ``resume``, exported to
    ``export_hf`` at the end, stopped (saving its step) at ``deadline`` (time.time())."""

    config: Path
    steps: int
    save_dir: Path
    export_hf: Path
    device: str
    seed: int
    log_interval: int
    save_interval: int
    profile_step: int
    resume: bool
    log: Path
    deadline: float | None

    def command(self, port: int) -> list[str]:
        """The deepspeed launcher's command (what follows ``ds_mtraining.train`` in it: train.py's
        arguments)."""
        extra = ["--save_interval", str(self.save_interval)] + (["--profile_step", str(self.profile_step)]
                                                                 if self.profile_step else [])
        command = training_command(self.config, self.steps, self.save_dir, self.device, port, self.seed,
                                   self.log_interval, self.export_hf, tuple(extra))
        if self.resume:
            command[command.index("--overwrite")] = "--resume"
        return command


def launch_training(run: TrainingLaunch) -> bool:
    """Trains ``run`` through the deepspeed launcher; True when it reached its steps and exported,
    False when the deadline stopped it (SIGTERM to its process group: the ranks finish the step,
    save it and exit 143; ``--resume`` continues)."""
    command = run.command(free_port())
    with open(run.log, "a") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=launcher_env(),
                                   start_new_session=True)
        stopped = False
        try:
            while process.poll() is None:
                if not stopped and run.deadline is not None and time.time() >= run.deadline:
                    os.killpg(process.pid, signal.SIGTERM)
                    stopped = True
                    try:
                        process.wait(STOP_GRACE_S)
                    except subprocess.TimeoutExpired:
                        os.killpg(process.pid, signal.SIGKILL)
                time.sleep(0.5)
        except BaseException:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
    if process.returncode == 0 and not stopped:
        return True
    if stopped:
        return False
    tail = "".join(run.log.read_text(errors="replace").splitlines(keepends=True)[-15:])
    raise RuntimeError(f"training {run.save_dir} failed (exit {process.returncode}); last lines of {run.log}:\n{tail}")


def _dense_stage_config(config: dict, questions: int, seq_len: int | None = None) -> dict:
    """A dense stage's DeepSpeed JSON: ``config`` (at ``seq_len`` if given) whose task samples ask
    ``questions`` times each (many answers a sample teach retrieval; the arms keep the study's
    config, one question, which the sparse estimator needs: docs/CONFIG.md)."""
    config = json.loads(json.dumps(config))
    config["mtraining"].setdefault("data", {}).update(passkey_questions=questions, task_questions=questions)
    if seq_len is not None:
        config["mtraining"]["seq_len"] = seq_len
    return config


def _sparse_spec(section: dict) -> dict:
    """A run's ``mtraining`` section's sparse settings as SparseConfig fields (with its stripe block)."""
    return {**section["sparse"], "block_size": section.get("stripe_block", 128)}


class LongStudy:
    """The stages of one long-context study in one folder (``--out``), each call running the stages
    it names that are not done yet: ``pretrain`` (dense, short), ``extend`` (dense, --extend_config
    at --extend_len continued from it, where the model learns to retrieve before the study's
    length; none with --extend_steps 0; their task samples ask --dense_stage_questions and
    --extend_questions times), ``probe`` (each dense stage's model's tasks at its own length,
    about --probe_trials each: a task the arms' start model does not solve there, the arms will
    not solve at the study's length; the short stage's line tells a task learned before the middle
    length from one learned there or not at all), ``budget`` (the slash budget for
    --density_target on the model the arms start from, at the study's length), ``dense`` /
    ``sparse`` / ``static`` (continued from that model's export at the study's length,
    same seed: the same token stream; static at sparse's final density), ``eval``
    (``ds_mtraining.eval`` of each ``arm:attention`` of --evals: loss by position and the
    RULER-style tasks at --eval_lengths) and ``compare`` (the result JSON, goals and plots). A call
    with --time_budget stops at its deadline with what it did saved (training: its step
    checkpointed; evaluation: its trials), and the next call continues; ``study.json`` keeps the
    settings of the first call."""

    def __init__(self, args, trainer=launch_training, say=print):
        self.out = Path(args.out)
        self.data = Path(args.data) if args.data else None
        self.device = args.device
        self.trainer, self.say_line = trainer, say
        self.start = time.time()
        self.deadline = None if args.time_budget is None else self.start + args.time_budget - RESERVE_S
        self.min_start_accuracy = args.min_start_accuracy
        self.out.mkdir(parents=True, exist_ok=True)
        self.settings = self._settings(args)

    def say(self, message: str):
        self.say_line(f"[{time.time() - self.start:7.1f} s] {message}")

    # ------------------------------------------------------------------ state
    def _settings(self, args) -> dict:
        """study.json: the first call's settings (its config files' contents too); a later call's
        differing option is refused, so that one study never mixes two recipes."""
        path = self.out / "study.json"
        given = {k: getattr(args, k) for k in LONG_DEFAULTS if getattr(args, k, None) is not None}
        if path.is_file():
            settings = json.loads(path.read_text())
            clash = {k: (v, settings["given"][k]) for k, v in given.items()
                     if k in settings["given"] and settings["given"][k] != v}
            if clash:
                raise ValueError(f"{path} holds a study with other settings: "
                                 + "; ".join(f"--{k} {a} (the study's: {b})" for k, (a, b) in clash.items())
                                 + "; leave them out, or give a new --out")
            return settings
        values = {**LONG_DEFAULTS, **given}
        base = json.loads(Path(values["config"]).read_text())
        pretrain = json.loads(Path(values["pretrain_config"]).read_text())
        extend = (_dense_stage_config(json.loads(Path(values["extend_config"]).read_text()),
                                      values["extend_questions"], values["extend_len"])
                  if values["extend_steps"] else None)
        settings = {"given": values, "base": base,
                    "pretrain": _dense_stage_config(pretrain, values["dense_stage_questions"]),
                    "extend": extend, "budget": None}
        write_json(path, settings)
        return settings

    def _save_settings(self):
        write_json(self.out / "study.json", self.settings)

    def _left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.time()

    def _data_file(self, name: str) -> Path:
        if self.data is None or not (self.data / name).is_file():
            raise FileNotFoundError(f"{self.data / name if self.data else '--data'} is missing; give --data, the "
                                    f"corpus folder (python -m ds_mtraining.eval.corpus --out DIR ...)")
        return self.data / name

    def done(self, stage: str) -> bool:
        if stage == "extend" and not self.settings["extend"]:
            return True
        if stage == "probe":
            return not self.settings["given"]["probe_trials"] or all(
                (self._eval_folder(probe_spec(name)) / "done.json").is_file() for name in dense_stages(self.settings))
        if stage in ("pretrain", "extend", *MODES):
            return (self.out / stage / "done.json").is_file()
        if stage == "budget":
            return self.settings["budget"] is not None or self.settings["given"]["density_target"] is None
        if stage == "eval":
            return all((self._eval_folder(e) / "done.json").is_file() for e in self.settings["given"]["evals"])
        return False

    def _eval_folder(self, spec: str) -> Path:
        return eval_folder(self.out, spec)

    # ------------------------------------------------------------------ stages
    def run(self, stages) -> list:
        """Runs ``stages`` (in the study's order) that are not done; returns the stages done now."""
        ran, start_checked = [], False
        for stage in LONG_STAGES:
            if stage not in stages or stage != "compare" and self.done(stage):
                continue
            left = self._left()
            if left is not None and left <= 0:
                self.say(f"{stage}: the call's time is spent; the next call continues")
                break
            if stage in MODES and not start_checked:  # once a call, before its first arm
                self._check_start_model()
                start_checked = True
            try:
                getattr(self, f"stage_{stage}")()
            except StageIncomplete as stop:
                self.say(str(stop))
                break
            ran.append(stage)
        return ran

    def _train(self, name: str, config: dict, steps: int):
        given, folder = self.settings["given"], self.out / name
        folder.mkdir(parents=True, exist_ok=True)
        write_json(folder / "config.json", config)
        run_dir = folder / "run"
        latest = run_dir / "latest"
        resume = latest.is_file() and (run_dir / latest.read_text().strip()).is_dir()  # its checkpoint is here
        self.say(f"{name}: {'resuming' if resume else 'training'} to {steps} steps at "
                 f"{config['mtraining']['seq_len']} tokens ({config['mtraining'].get('attention', 'sparse')})")
        timing_path = folder / "timing.json"
        timing = json.loads(timing_path.read_text()) if timing_path.is_file() else {"train_s": 0.0, "calls": 0}
        began = time.time()
        finished = self.trainer(TrainingLaunch(folder / "config.json", steps, run_dir, folder / "hf", self.device,
                                            given["seed"], given["log_interval"], given["save_interval"],
                                            given["profile_step"], resume, folder / "train.log", self.deadline))
        timing.update(train_s=timing["train_s"] + time.time() - began, calls=timing["calls"] + 1)
        write_json(timing_path, timing)
        if not finished:
            raise StageIncomplete(f"{name}: stopped at the deadline, its step saved in {run_dir}; the next call "
                                  f"resumes it")
        write_json(folder / "done.json", {"steps": steps, **timing})
        self.say(f"{name}: done in {timing['train_s']:.0f} s over {timing['calls']} call(s)")
        if name == start_stage(self.settings):
            self._keep_start_pack()

    def stage_pretrain(self):
        given = self.settings["given"]
        config = mode_config(self.settings["pretrain"], "dense", given["pretrain_steps"],
                             str(self._data_file("train.parquet")))
        self._train("pretrain", config, given["pretrain_steps"])

    def stage_extend(self):
        given = self.settings["given"]
        config = mode_config(self.settings["extend"], "dense", given["extend_steps"],
                             str(self._data_file("train.parquet")), model=self._export("pretrain"))
        self._train("extend", config, given["extend_steps"])

    def _export(self, stage: str) -> str:
        """The exported model of a training stage that is done (trained again where this machine lacks it)."""
        if not (self.out / stage / "done.json").is_file():
            raise ValueError(f"the next stage continues from the {stage} stage's model: run that stage first")
        self._ensure_model(stage)
        return str((self.out / stage / "hf").resolve())

    def _start_model(self) -> str:
        return self._export(start_stage(self.settings))

    def stage_probe(self):
        """Each dense stage's model's tasks (and loss) at its own length, before the arms spend their time."""
        for stage in dense_stages(self.settings):
            folder, length = self._eval_folder(probe_spec(stage)), self.settings[stage]["mtraining"]["seq_len"]
            if (folder / "done.json").is_file():
                continue
            self._export(stage)
            self.say(f"probe: the {stage} model's tasks at its own length, {length} tokens")
            self._evaluate(probe_spec(stage), length, self.settings["given"]["probe_trials"])
            write_json(folder / "done.json", _json(folder / f"done_{length}.json"))
            tasks = (eval_results(folder) or {}).get("tasks", {})
            solved = {task: cell[str(length)]["accuracy"] for task, cell in tasks.items() if str(length) in cell}
            start = stage == start_stage(self.settings)
            self.say(f"probe ({stage}): " + ", ".join(f"{task} {100 * a:.0f}%" for task, a in solved.items())
                     + "".join(f"; {task} below 50%: the arms' comparison on it will say little"
                               for task, a in solved.items() if start and a < 0.5))

    def _ensure_model(self, stage: str):
        """A stage done in an earlier session whose exported model is not here (a bare machine: the
        models, 0.1-0.3 GB each, do not come back through the device's output folder whole): the
        start model from its pack where the study has one (``START_PACK``: brought back from the
        machine that trained it and carried to this one, scripts/quality_model.sh), any other
        trained again with the same settings, seed and data; its evaluations keep their trials,
        each row naming the model it ran on (``model``: the weights' fingerprint)."""
        hf = self.out / stage / "hf"
        if not (hf / "config.json").is_file():
            pack = self.out / START_PACK
            if stage == start_stage(self.settings) and (pack / MANIFEST).is_file():
                self.say(f"{stage}: its model from the pack in {pack}")
                unpack_model(pack, hf)  # a missing part stops the study, naming it (no silent retraining)
            else:
                self.say(f"{stage}: done in an earlier session, its model is not on this machine: training it again")
                getattr(self, f"stage_{stage}")()
        if stage == start_stage(self.settings):
            self._keep_start_pack()

    def _keep_start_pack(self):
        """The start model as a pack in ``START_PACK`` (once): what a later stay on a bare machine
        continues the arms from. In bfloat16 where the arms train in bf16 (nothing they see is lost)."""
        pack = self.out / START_PACK
        if (pack / MANIFEST).is_file():
            return
        bf16 = bool(self.settings["base"].get("bf16", {}).get("enabled"))
        files = pack_model(self.out / start_stage(self.settings) / "hf", pack, bf16=bf16)
        self.say(f"{start_stage(self.settings)}: its model packed in {pack} ({len(files)} files, "
                 f"{sum(f.stat().st_size for f in files) / 2**20:.0f} MiB{', bf16' if bf16 else ''})")

    def _base(self) -> dict:
        """The arms' config: the study's, with the chosen slash budget."""
        base = json.loads(json.dumps(self.settings["base"]))
        if self.settings["budget"] is not None:
            chosen = self.settings["budget"]["chosen"]
            base["mtraining"]["sparse"] = {k: v for k, v in chosen.items() if k != "block_size"}
        return base

    def stage_budget(self):
        given = self.settings["given"]
        self.say(f"budget: the most generous slash budget of density <= {given['density_target']} on the "
                 f"model the arms start from, at {self.settings['base']['mtraining']['seq_len']} tokens")
        device = "cuda" if self.device.startswith("cuda") else "cpu"
        choice = choose_budget(self._start_model(), self.settings["base"], str(self._data_file("train.parquet")),
                               given["density_target"], device)
        self.settings["budget"] = choice
        self._save_settings()
        _release_memory()  # the arms train in other processes on the same GPU
        self.say(f"budget: max_slash_diagonals={choice['chosen']['max_slash_diagonals']} "
                 f"(density {choice['density']:.4f})")

    def _trained_tasks(self, stage: str) -> list[str]:
        """The tasks mixed into a dense stage's samples (its config's ``mtraining.data``)."""
        data = self.settings[stage]["mtraining"].get("data", {})
        return (["passkey"] if data.get("passkey_fraction") else []) + sorted(
            task for task, share in data.get("task_fractions", {}).items() if share)

    def _check_start_model(self):
        """Stops before an arm whose start model's probe solves less than --min_start_accuracy of a
        task its dense stages trained: such a model has not learned to copy what it retrieves
        (benchmarks/probes/copy_onset.py: a recipe's copy onset), every task would compare 0 with 0,
        and the arms' training and evaluation are the study's longest part."""
        if not self.min_start_accuracy:
            return
        start = start_stage(self.settings)
        probe = (probe_results(self.out, self.settings) or {}).get(start)
        if probe is None:
            self.say(f"arms: no probe of the {start} model (--probe_trials 0, or the probe stage not run): "
                     f"they start from it unchecked")
            return
        length = str(probe["length"])
        cells = [(task, probe["tasks"].get(task, {}).get(length)) for task in self._trained_tasks(start)]
        failed = [(task, cell) for task, cell in cells if cell and cell["trials"]
                  and cell["accuracy"] < self.min_start_accuracy]
        if failed:
            raise RuntimeError(
                f"the arms' start model (the {start} stage's, probed at {length} tokens) solves "
                + ", ".join(f"{task} in {cell['correct']} of {cell['trials']}" for task, cell in failed)
                + f", under --min_start_accuracy {self.min_start_accuracy:g}: it has not learned to retrieve yet, and the "
                f"arms would compare little. Train its dense stages further (a new --out with more --pretrain_steps / "
                f"--extend_steps, or more --dense_stage_questions), or pass --min_start_accuracy 0 to train the "
                f"arms anyway")

    def _arm(self, mode: str):
        given = self.settings["given"]
        density = None
        if mode == "static":  # at MTraining's final density, fixed once (a retrained sparse arm keeps it)
            if self.settings.get("static_density") is None:
                if not (self.out / "sparse" / "done.json").is_file():
                    raise ValueError("static trains at MTraining's density: run the sparse stage first")
                self.settings["static_density"] = tail_mean(read_metric(self.out / "sparse" / "run", "density")[1])
                self._save_settings()
            density = self.settings["static_density"]
        config = mode_config(self._base(), mode, given["steps"], str(self._data_file("train.parquet")), density,
                             self._start_model())
        self._train(mode, config, given["steps"])

    def stage_dense(self):
        self._arm("dense")

    def stage_sparse(self):
        self._arm("sparse")

    def stage_static(self):
        self._arm("static")

    def eval_argv(self, spec: str, length: int, time_budget: float | None, max_trials: int | None = None) -> list[str]:
        """The ``ds_mtraining.eval`` command line of one ``arm:attention`` evaluation at ``length``
        (its held-out stream and prompts depend on that length alone: the same for every arm;
        ``max_trials``: the study's --max_trials when None)."""
        given = self.settings["given"]
        arm, attention = spec.split(":")
        lengths = str(length)
        argv = [str(self.out / arm / "hf"), "--out", str(self._eval_folder(spec)), "--tasks", "loss,ruler",
                "--attention", attention, "--sparse_config", json.dumps(_sparse_spec(self._base()["mtraining"])),
                "--lengths", lengths, "--loss_lengths", lengths, "--ruler_lengths", lengths,
                "--loss_windows", str(given["loss_windows"]), "--buckets", str(given["buckets"]),
                "--ruler_tasks", ",".join(given["ruler_tasks"]), "--depths", ",".join(str(d) for d in given["depths"]),
                "--trials", str(given["trials"]), "--target_width", str(given["target_width"]),
                "--max_trials", str(max_trials or given["max_trials"]),
                "--data", str(self._data_file("heldout.parquet")),
                "--tokenizer", "bytes" if self._base()["mtraining"].get("tokenizer", "bytes") == "bytes" else "auto",
                "--device", "cuda" if self.device.startswith("cuda") else "cpu", "--seed", str(given["seed"]),
                "--dense_kernel", given["dense_kernel"], "--no_progress"]
        if attention == "static":
            if self.settings.get("static_density") is None:
                raise ValueError(f"eval {spec}: static attention serves the static arm's density; train it first")
            argv += ["--static_density", str(self.settings["static_density"])]
        return argv + (["--time_budget", f"{time_budget:.0f}"] if time_budget is not None else [])

    def stage_eval(self):
        """The evaluations of --evals, the longest length first across all of them (the goals' length
        is measured first where a session's time runs out), in this process; each keeps its trials
        in its folder, so a call that runs out of time leaves them for the next."""
        given = self.settings["given"]
        for length in sorted(given["eval_lengths"], reverse=True):
            for spec in given["evals"]:
                folder, arm = self._eval_folder(spec), spec.split(":")[0]
                if (folder / "done.json").is_file() or (folder / f"done_{length}.json").is_file():
                    continue
                if not (self.out / arm / "done.json").is_file():
                    self.say(f"eval {spec}: the {arm} arm is not trained yet; skipped")
                    continue
                self._ensure_model(arm)
                self.say(f"eval {spec}: loss and tasks at {length} tokens")
                spent = self._evaluate(spec, length)
                if all((folder / f"done_{n}.json").is_file() for n in given["eval_lengths"]):
                    write_json(folder / "done.json", {"eval_s": spent})

    def _evaluate(self, spec: str, length: int, max_trials: int | None = None) -> float:
        """One ``ds_mtraining.eval`` of ``spec`` at ``length`` in this process, until the call's
        deadline (its trials kept: StageIncomplete, and the next call continues); marks the length
        done and returns the evaluation's seconds over all calls."""
        from ..eval.cli import build_parser, check_args, run_eval
        folder, left = self._eval_folder(spec), self._left()
        if left is not None and left <= 0:
            raise StageIncomplete(f"eval {spec}: the call's time is spent; the next call continues")
        began = time.time()
        parser = build_parser()
        args = parser.parse_args(self.eval_argv(spec, length, left, max_trials))
        check_args(parser, args)
        summary = run_eval(args)
        timing_path = folder / "timing.json"
        spent = (_json(timing_path) or {"eval_s": 0.0})["eval_s"] + time.time() - began
        write_json(timing_path, {"eval_s": spent})
        _release_memory()
        if not summary.get("ruler_complete") or str(length) not in summary.get("loss_by_length", {}):
            raise StageIncomplete(f"eval {spec}: stopped at the deadline, its trials kept in {folder}; the "
                                  f"next call continues")
        write_json(folder / f"done_{length}.json", {"eval_s": spent})
        return spent

    def stage_compare(self):
        self.results = long_results(self.out)


def _release_memory():
    import gc
    gc.collect()
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def arm_results(folder: Path) -> dict | None:
    """One arm's (or the pretraining's) training: loss and density curves, final density, tokens/s,
    seconds per step, and from its profiled step attention's share of the step."""
    run = folder / "run"
    if not metric_path(run, "loss").is_file():
        return None
    steps, loss = read_metric(run, "loss")
    _, density = read_metric(run, "density")
    _, speed = read_metric(run, "tokens_per_s")
    config = json.loads((folder / "config.json").read_text())
    tokens = config["mtraining"]["seq_len"] * config.get("train_micro_batch_size_per_gpu", 1)
    rates = speed[1:] if len(speed) > 2 else speed  # the first interval holds the warm-up steps
    result = {"train_steps": steps.tolist(), "train_loss": loss.tolist(), "density": density.tolist(),
              "final_density": tail_mean(density), "tokens_per_s": float(np.median(rates)),
              "step_s": float(tokens / np.median(rates)), "seq_len": config["mtraining"]["seq_len"],
              "attention": config["mtraining"].get("attention", "sparse"), "done": (folder / "done.json").is_file(),
              "timing": _json(folder / "timing.json"), "sparse": config["mtraining"].get("sparse"),
              "static": config["mtraining"].get("static")}
    profiles = sorted(run.glob("profile_step*_rank0.json"))
    if profiles:
        from ..training.profile import ATTENTION_KINDS
        profile = json.loads(profiles[-1].read_text())
        shares = profile["share_by_kind"]
        result["profile"] = {"step": profile["step"], "measured": profile["measured"], "step_s": profile["step_s"],
                             "share_by_kind": shares,
                             "attention_share": float(sum(shares.get(kind, 0.0) for kind in ATTENTION_KINDS))}
    return result


def eval_results(folder: Path) -> dict | None:
    """One ``arm:attention`` evaluation: loss by position per length (with each layer's density
    under sparse attention) and the tasks' summary, recomputed from its trials."""
    from ..eval.ruler import summarise
    losses, ruler = _json(folder / "loss_by_length.json"), _json(folder / "ruler.json")
    trials = _json(folder / "ruler_trials.json")
    if losses is None and trials is None:
        return None
    result = {"done": (folder / "done.json").is_file(), "timing": _json(folder / "timing.json"), "loss": {},
              "tasks": summarise(trials["rows"], ruler["target_width"]) if trials and ruler else {},
              "task_layer_density": (ruler or {}).get("layer_density", {})}
    # the models the rows ran on: more than one where an arm was trained again on a bare machine
    result["models"] = sorted({r.get("model") for r in (trials or {}).get("rows", [])} | {
        c.get("model") for c in (losses or {}).get("results", {}).values()} - {None})
    for length, cell in (losses or {}).get("results", {}).items():
        result["loss"][length] = {"heldout_loss": cell["overall"], "last_bucket_loss": cell["mean_loss"][-1],
                                  "edges": cell["edges"], "mean_loss": cell["mean_loss"],
                                  "tokens": int(sum(cell["tokens"])), "layer_density": cell.get("layer_density")}
    return result


def eval_folder(study: Path, spec: str) -> Path:
    """Where the evaluation ``arm:attention`` of a study keeps its trials and results."""
    arm, attention = spec.split(":")
    return study / arm / f"eval_{attention}"


def dense_stages(settings: dict) -> tuple[str, ...]:
    """The study's dense stages, in order."""
    return ("pretrain", "extend") if settings["extend"] else ("pretrain",)


def start_stage(settings: dict) -> str:
    """The dense stage whose model the budget is chosen on and the arms continue from: the last one."""
    return dense_stages(settings)[-1]


def probe_spec(stage: str) -> str:
    """The probe's evaluation of a dense stage: its model under dense attention."""
    return f"{stage}:dense"


def probe_results(study: Path, settings: dict) -> dict | None:
    """The probes (each dense stage's model: its tasks and loss at its own length) by stage, those
    run so far; None without probes."""
    if not settings["given"]["probe_trials"]:
        return None
    found = {stage: eval_results(eval_folder(study, probe_spec(stage))) for stage in dense_stages(settings)}
    return {stage: {"length": settings[stage]["mtraining"]["seq_len"], **probe}
            for stage, probe in found.items() if probe}


def _goal(passed, value, limit, margin, change: str, **extra) -> dict:
    """A goal's verdict: pass (None where its inputs are missing), the value, the limit, the margin
    (positive: inside the limit by that much) and, where missed, what to change."""
    goal = {"pass": passed, "value": value, "limit": limit, "margin": margin, **extra}
    if passed is False:
        goal["change"] = change
    return goal


def long_goals(results: dict) -> dict:
    """Issue 52's goals at the study's longest length, each pass/fail with its margin: MTraining's
    held-out loss within 1% of dense overall and 2% in the last position bucket (both evaluated
    with dense attention), every task's accuracy within 2 points of dense or the two 95% intervals
    overlapping, MTraining's density at most 10%, every interval narrower than 4 points, static
    failing the tasks (its interval below dense's), and the tokens/s ratio of the arms."""
    length = str(max(results["params"]["eval_lengths"]))
    evals, arms = results["evals"], results["arms"]
    dense, sparse = evals.get("dense:dense"), evals.get("sparse:dense")
    goals = {"length": int(length)}

    def loss(ev, key):
        return (ev or {}).get("loss", {}).get(length, {}).get(key)

    for key in ("heldout_loss", "last_bucket_loss"):
        limit = GOALS[f"{key}_gap"]
        d, s = loss(dense, key), loss(sparse, key)
        gap = None if d is None or s is None else s / d - 1.0
        goals[f"sparse_{key}_gap_le_{limit:g}"] = _goal(
            None if gap is None else gap <= limit, gap, limit, None if gap is None else limit - gap,
            "more steps at the study's length (the gap of an arm still adapting to it shrinks), or a larger "
            "slash budget (--density_target)", compared="sparse:dense vs dense:dense")
    for task in results["params"]["ruler_tasks"]:
        d = (dense or {}).get("tasks", {}).get(task, {}).get(length)
        s = (sparse or {}).get("tasks", {}).get(task, {}).get(length)
        if not d or not s:
            goals[f"{task}_accuracy_within_2_points"] = _goal(None, None, GOALS["accuracy_points"], None, "")
            continue
        points = 100 * (s["accuracy"] - d["accuracy"])
        overlap = s["interval"][1] >= d["interval"][0] and d["interval"][1] >= s["interval"][0]
        goals[f"{task}_accuracy_within_2_points"] = _goal(
            points >= -GOALS["accuracy_points"] or overlap, points, -GOALS["accuracy_points"],
            points + GOALS["accuracy_points"], "more trials (--max_trials) where the intervals are wide; else a "
            "larger slash budget or more steps", intervals_overlap=overlap, dense=d["accuracy"], sparse=s["accuracy"],
            dense_interval=d["interval"], sparse_interval=s["interval"])
        goals[f"{task}_dense_learned"] = _goal(d["accuracy"] >= 0.5, d["accuracy"], 0.5, d["accuracy"] - 0.5,
                                               "the dense arm does not solve the task at this length: the "
                                               "comparison says little; train on it longer (task_fractions, steps)")
    density = (arms.get("sparse") or {}).get("final_density")
    goals["sparse_density_le_0.1"] = _goal(
        None if density is None else density <= GOALS["density"], density, GOALS["density"],
        None if density is None else GOALS["density"] - density, "a lower --density_target (a smaller slash budget)",
        measured="the mean over the last tenth of the sparse arm's training steps",
        eval_layer_density=(evals.get("sparse:sparse") or {}).get("loss", {}).get(length, {}).get("layer_density"))
    cells = [(spec, task, cell[length]) for spec, ev in evals.items() if ev
             for task, cell in ev.get("tasks", {}).items() if length in cell]
    widest = max(cells, key=lambda c: c[2]["width"], default=None)
    goals["intervals_narrower_than_4_points"] = _goal(
        None if widest is None else widest[2]["width"] < GOALS["interval_width"],
        None if widest is None else widest[2]["width"], GOALS["interval_width"],
        None if widest is None else GOALS["interval_width"] - widest[2]["width"],
        "more trials: --max_trials (eval.ruler.trials_for_width gives the count at an accuracy)",
        widest=None if widest is None else {"eval": widest[0], "task": widest[1], "trials": widest[2]["trials"]})
    static = evals.get("static:static")
    for task in results["params"]["ruler_tasks"]:
        d = (dense or {}).get("tasks", {}).get(task, {}).get(length)
        t = (static or {}).get("tasks", {}).get(task, {}).get(length)
        below = None if not d or not t else t["interval"][1] < d["interval"][0]
        goals[f"static_fails_{task}"] = _goal(below, None if not t else t["accuracy"], None if not d else d["interval"][0],
                                              None if below is None else d["interval"][0] - t["interval"][1],
                                              "the task does not need long-range retrieval at this length "
                                              "(a window at this density sees it): place the needles farther")
    d, s = arms.get("dense"), arms.get("sparse")
    goals["tokens_per_s_ratio_sparse_over_dense"] = None if not d or not s else s["tokens_per_s"] / d["tokens_per_s"]
    return goals


def long_results(study: Path) -> dict:
    """Everything a study folder holds so far (stages not run: absent or None): the arms' training,
    the evaluations, the goals (:func:`long_goals`) and the comparisons at every length."""
    settings = json.loads((study / "study.json").read_text())
    extend = settings["extend"]
    params = {**settings["given"], "seq_len": settings["base"]["mtraining"]["seq_len"],
              "pretrain_seq_len": settings["pretrain"]["mtraining"]["seq_len"],
              "extend_seq_len": extend["mtraining"]["seq_len"] if extend else None,
              "model": settings["base"]["mtraining"]["model"], "budget": settings["budget"]}
    results = {"params": params, "pretrain": arm_results(study / "pretrain"),
               "extend": arm_results(study / "extend") if extend else None,
               "probes": probe_results(study, settings),
               "arms": {mode: arm_results(study / mode) for mode in MODES},
               "evals": {spec: eval_results(eval_folder(study, spec))
                         for spec in settings["given"]["evals"]}}
    rows = []
    for spec, ev in results["evals"].items():
        for length in sorted({int(n) for n in (ev or {}).get("loss", {})} |
                             {int(n) for c in (ev or {}).get("tasks", {}).values() for n in c}):
            row = {"arm": spec.split(":")[0], "eval_attention": spec.split(":")[1], "length": length}
            row.update({k: v for k, v in ev["loss"].get(str(length), {}).items()
                        if k in ("heldout_loss", "last_bucket_loss", "tokens")})
            layer = ev["loss"].get(str(length), {}).get("layer_density")
            if layer:
                row["density"] = float(np.mean(layer))
            for task, cell in ev["tasks"].items():
                if str(length) in cell:
                    row[task] = {k: cell[str(length)][k] for k in ("accuracy", "interval", "trials", "correct")}
            rows.append(row)
    results["rows"] = rows
    results["comparisons"] = long_comparisons(results["evals"])
    results["goals"] = long_goals(results)
    return results


def long_comparisons(evals: dict, baseline: str = "dense:dense") -> dict:
    """Every other evaluation against dense's at every length both hold: relative held-out and
    last-bucket loss gaps (positive: worse than dense) and each task's accuracy difference in points
    (positive: better), with whether the two 95% intervals overlap."""
    base, found = evals.get(baseline), {}
    for spec, ev in evals.items():
        if spec == baseline or not ev or not base:
            continue
        for length, cell in ev["loss"].items():
            if length in base["loss"]:
                found.setdefault(f"{spec} vs {baseline}", {})[length] = {
                    key: cell[key] / base["loss"][length][key] - 1.0 for key in ("heldout_loss", "last_bucket_loss")}
        for task, by_length in ev["tasks"].items():
            for length, cell in by_length.items():
                other = base["tasks"].get(task, {}).get(length)
                if other:
                    found.setdefault(f"{spec} vs {baseline}", {}).setdefault(length, {})[task] = {
                        "points": 100 * (cell["accuracy"] - other["accuracy"]),
                        "intervals_overlap": cell["interval"][1] >= other["interval"][0]
                                             and other["interval"][1] >= cell["interval"][0]}
    return found


def long_plots(results: dict, path: Path) -> list[str]:
    """Loss curves (pretraining and arms) and density in training; accuracy by task and length
    (95% intervals) and by depth at the longest length; loss by position and each layer's density
    per length: three PNGs beside the result JSON ``path`` (``record.plot_path``). [] with one line
    where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib, then run the compare stage again)")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {"dense": "black", "sparse": "tab:blue", "static": "tab:orange", "pretrain": "gray"}
    styles = {"dense": "-", "sparse": "--"}
    names = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    offset = 0
    for stage, color in (("pretrain", "gray"), ("extend", "tab:green")):  # the dense stages, one after the other
        if results.get(stage):
            axes[0].plot(np.array(results[stage]["train_steps"]) + offset, results[stage]["train_loss"], color=color,
                         lw=1, label=f"{stage} ({results[stage]['seq_len']} tokens)")
            offset += results[stage]["train_steps"][-1]
    for mode, arm in results["arms"].items():
        if arm:
            axes[0].plot(np.array(arm["train_steps"]) + offset, arm["train_loss"], color=colors[mode], lw=1,
                         label=f"{mode} ({arm['seq_len']} tokens, {arm['tokens_per_s']:.0f} tokens/s)")
            if mode != "dense":
                axes[1].plot(arm["train_steps"], arm["density"], color=colors[mode], label=mode)
    axes[0].set(xlabel="step", ylabel="training loss (nats/token)", title="training loss")
    axes[1].axhline(GOALS["density"], color="gray", ls="--", lw=0.8, label="10%")
    axes[1].set(xlabel="step of the arm", ylabel="computed / causal entries", title="attention density in training")
    for ax in axes:
        _legend(ax)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    names.append(_save(fig, plt, plot_path(path, "curves")))

    tasks, evals = results["params"]["ruler_tasks"], {k: v for k, v in results["evals"].items() if v}
    lengths, longest = results["params"]["eval_lengths"], str(max(results["params"]["eval_lengths"]))
    fig, axes = plt.subplots(2, len(tasks), figsize=(4 * len(tasks), 7), squeeze=False)
    width = 0.8 / max(1, len(evals))
    for column, task in enumerate(tasks):
        top, bottom = axes[0][column], axes[1][column]
        for i, (spec, ev) in enumerate(evals.items()):
            arm, attention = spec.split(":")
            cells = [ev["tasks"].get(task, {}).get(str(n)) for n in lengths]
            x = [j + (i - (len(evals) - 1) / 2) * width for j, c in enumerate(cells) if c]
            y = [c["accuracy"] for c in cells if c]
            err = [[c["accuracy"] - c["interval"][0] for c in cells if c], [c["interval"][1] - c["accuracy"] for c in cells if c]]
            top.bar(x, y, width, yerr=err, color=colors[arm], alpha=0.9 if attention == "dense" else 0.5,
                    capsize=2, label=f"{arm} ({attention} eval)")
            cell = ev["tasks"].get(task, {}).get(longest)
            if cell:
                depths = sorted(cell["by_depth"], key=float)
                bottom.plot([float(d) for d in depths], [cell["by_depth"][d]["accuracy"] for d in depths], "o",
                            ls=styles.get(attention, ":"), color=colors[arm], label=f"{arm} ({attention} eval)")
        top.set_xticks(range(len(lengths)), [_k(n) for n in lengths])
        top.set(ylim=(0, 1.05), title=task, xlabel="prompt length", ylabel="accuracy (95% interval)" if not column else None)
        bottom.set(ylim=(-0.05, 1.05), xlabel="depth of the first needle", title=f"{task} at {_k(int(longest))}",
                   ylabel="accuracy" if not column else None)
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    _legend(axes[0][0])
    fig.tight_layout()
    names.append(_save(fig, plt, plot_path(path, "tasks")))

    fig, axes = plt.subplots(2, len(lengths), figsize=(4.5 * len(lengths), 7), squeeze=False)
    for column, n in enumerate(lengths):
        for spec, ev in evals.items():
            cell = ev["loss"].get(str(n))
            if not cell:
                continue
            arm, attention = spec.split(":")
            axes[0][column].stairs(cell["mean_loss"], cell["edges"], color=colors[arm], ls=styles.get(attention, ":"),
                                   label=f"{arm} ({attention} eval) {cell['heldout_loss']:.4f}")
            if cell.get("layer_density"):
                axes[1][column].plot(cell["layer_density"], "o-", color=colors[arm], label=f"{arm} ({attention} eval)")
        axes[0][column].set(title=f"held-out loss by position, {_k(n)}", xlabel="position (tokens)",
                            ylabel="mean loss (nats)" if not column else None)
        axes[1][column].axhline(GOALS["density"], color="gray", ls="--", lw=0.8)
        axes[1][column].set(title=f"index density per layer, {_k(n)}", xlabel="layer",
                            ylabel="computed / causal entries" if not column else None)
        for ax in axes[:, column]:
            _legend(ax)
            ax.grid(alpha=0.3)
    fig.tight_layout()
    names.append(_save(fig, plt, plot_path(path, "loss")))
    return names


def _legend(ax):
    """The axes' legend, where it has labelled lines (a study part-way through has none yet)."""
    if ax.get_legend_handles_labels()[1]:
        ax.legend(fontsize=7)


def _save(fig, plt, path: Path) -> str:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _percent(value, digits=2) -> str:
    return "n/a" if value is None else f"{100 * value:+.{digits}f}%"


def _k(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def results_row(results: dict, command: str, json_name: str, device: str = "one H200") -> str:
    """The docs/RESULTS.md row of a study, filled from its numbers (for a person to check and paste)."""
    goals, params = results["goals"], results["params"]
    arms = results["arms"]
    length = goals["length"]
    tasks = ", ".join(
        f"{task} {100 * g['sparse']:.1f}% vs {100 * g['dense']:.1f}%" for task in params["ruler_tasks"]
        if (g := goals.get(f"{task}_accuracy_within_2_points", {})).get("value") is not None)
    static = ", ".join(f"{task} {100 * g['value']:.1f}%" for task in params["ruler_tasks"]
                       if (g := goals.get(f"static_fails_{task}", {})).get("value") is not None)
    ratio = goals.get("tokens_per_s_ratio_sparse_over_dense")
    density = goals["sparse_density_le_0.1"]["value"]
    missed = [name for name, g in goals.items() if isinstance(g, dict) and g.get("pass") is False]
    return (f"| <a id=\"quality-{_k(length).lower()}\"></a>{_model_name(params['model'])} continued at {_k(length)} for "
            f"{params['steps']} steps from dense stages at {_k(params['pretrain_seq_len'])} "
            f"({params['pretrain_steps']} steps){_dense_stage_words(params)}, {device}"
            f"{_probe_words(results.get('probes'))}; MTraining's density "
            f"{'n/a' if density is None else f'{density:.3f}'} at the end | "
            f"held-out loss **{_percent(goals['sparse_heldout_loss_gap_le_0.01']['value'])}** of dense, last "
            f"position bucket {_percent(goals['sparse_last_bucket_loss_gap_le_0.02']['value'])} (dense evaluation); "
            f"tasks at {_k(length)} (MTraining vs dense): {tasks or 'n/a'}; static sinks + window: {static or 'n/a'}; "
            f"tokens/s {'n/a' if ratio is None else f'{ratio:.2f}x'} dense's (attention "
            f"{_share(arms.get('dense'))} / {_share(arms.get('sparse'))} of the step, dense / MTraining)"
            f"{'; goals missed: ' + ', '.join(missed) if missed else ''} | `{command}` | `{json_name}` |")


def _dense_stage_words(params: dict) -> str:
    extend = params.get("extend_seq_len")
    words = f" and {_k(extend)} ({params['extend_steps']} steps)" if extend else ""
    asked = [params.get("dense_stage_questions", 1)] + ([params.get("extend_questions", 1)] if extend else [])
    if max(asked) == 1:
        return words
    return words + f", {' and '.join(map(str, dict.fromkeys(asked)))} questions a task sample"


def _probe_words(probes) -> str:
    """The dense stages' task accuracy at their own lengths, before the arms: where the arms could learn from."""
    if not probes:
        return ""
    words = []
    for probe in probes.values():
        length = str(probe["length"])
        solved = ", ".join(f"{task} {100 * cell[length]['accuracy']:.0f}%" for task, cell in probe["tasks"].items()
                           if length in cell)
        words.append(f"the {_k(probe['length'])} model: {solved or 'n/a'}")
    return f" (before them, {'; '.join(words)})"


def _model_name(model) -> str:
    """A model spec in words: a preset with its overrides (the 61M shape: hidden 768, 10 layers)."""
    if isinstance(model, str):
        return model
    overrides = model.get("config_overrides", {})
    shape = ", ".join(f"{k.replace('num_', '').replace('_', ' ')} {v}" for k, v in overrides.items())
    return f"{model.get('name_or_path')} ({shape})" if shape else str(model.get("name_or_path"))


def _share(arm) -> str:
    share = ((arm or {}).get("profile") or {}).get("attention_share")
    return "n/a" if share is None else f"{100 * share:.0f}%"


def long_main(args, trainer=launch_training, say=print) -> dict | None:
    """``bench.quality long``: the stages asked for, then (with compare) the result JSON and plots;
    returns the results with compare (``path``: the JSON file written)."""
    stages = LONG_STAGES if args.stages == "all" else [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = sorted(set(stages) - set(LONG_STAGES))
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; the stages are {list(LONG_STAGES)} or 'all'")
    study = LongStudy(args, trainer, say)
    ran = study.run(stages)
    print(f"stages done in this call: {', '.join(ran) or 'none'}; the study: " +
          ", ".join(f"{s} {'done' if study.done(s) else 'not done'}" for s in LONG_STAGES if s != "compare"))
    if "compare" in stages:
        results = study.results if "compare" in ran else long_results(study.out)
        out = Path(args.results) if args.results else study.out
        out.mkdir(parents=True, exist_ok=True)
        tag = args.tag or study.out.name
        path = result_path(f"quality_{tag}", folder=out)
        command = os.environ.get("QUALITY_128K_COMMAND") or " ".join(["python -m ds_mtraining.bench.quality"] + sys.argv[1:])
        results["plots"] = long_plots(results, path)
        device = _device_name()
        results["results_row"] = results_row(results, command, path.name, "CPU" if device == "cpu" else f"one {device}")
        results["stages_done"] = [s for s in LONG_STAGES if s != "compare" and study.done(s)]
        write_result(f"quality_{tag}", results.pop("params"), results.pop("rows"), path=path, command=command,
                     study=str(study.out), **results)
        for name, goal in results["goals"].items():
            if isinstance(goal, dict):
                verdict = {True: "yes", False: "NO ", None: " - "}[goal["pass"]]
                margin = "" if goal["margin"] is None else f" (margin {goal['margin']:+.4g})"
                print(f"  {verdict}  {name}{margin}")
        print(f"results: {path}")
        print(results["results_row"])
        return {**results, "path": str(path)}
    return None


# ----------------------------------------------------------------------------- command line
def parse_args(argv=None):
    """The command line's arguments (``long``'s list settings as lists)."""
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
    long = sub.add_parser("long", help="the long-context study (issue 52): pretrain, budget, dense / sparse / static "
                                       "arms at the study's length, evaluation, compare; stages selectable per call, "
                                       "resumed in --out")
    long.add_argument("--out", required=True, help="the study's folder (study.json keeps its first call's settings)")
    long.add_argument("--data", default=None, help="corpus folder with train.parquet and heldout.parquet")
    long.add_argument("--stages", default="all", help="comma-separated of " + ",".join(LONG_STAGES) + ", or all "
                                                      "(stages done are skipped; compare always runs when named)")
    long.add_argument("--device", default="cuda:0", help="'cuda:0' or 'cpu'")
    long.add_argument("--time_budget", type=float, default=None,
                      help=f"seconds for this call: training stops (its step saved) and evaluation stops (its "
                           f"trials kept) {RESERVE_S} s before; the next call continues")
    long.add_argument("--tag", default=None, help="results name quality_<tag>_<device>_<date>.json (default: the "
                                                  "folder's name)")
    long.add_argument("--results", default=None, help="where the JSON and PNGs go (default: --out)")
    long.add_argument("--min_start_accuracy", type=float, default=DEFAULT_MIN_START_ACCURACY,
                      help="an arm trains only if the start model's probe solves at least this share of each task "
                           "its dense stages trained (0: no check); per call, not fixed by the study")
    for name, value in LONG_DEFAULTS.items():  # the study's settings: None keeps study.json's (or the default)
        kind = {list: str, float: float, int: int, str: str}[type(value)]
        if name == "density_target":
            kind = float
        long.add_argument(f"--{name}", type=kind, default=None,
                          help=f"fixed by the study's first call; default {','.join(map(str, value)) if isinstance(value, list) else value}")
    cmp = sub.add_parser("compare", help="write quality_<tag>.json and PNGs from a study directory",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    cmp.add_argument("study", help="the study directory of a run")
    cmp.add_argument("--tag", default=None, help="default: the study folder's name")
    cmp.add_argument("--results", default=None, help="where quality_<tag>.json and PNGs go (default: the study)")
    args = parser.parse_args(argv)
    if args.command == "run":
        if (args.steps is not None and args.steps < 1) or args.calibration_steps < 2:
            parser.error("--steps must be >= 1 and --calibration_steps >= 2")
        if bool(args.pretrain_config) != (args.pretrain_steps > 0):
            parser.error("--pretrain_config and --pretrain_steps >= 1 go together")
    if args.command == "long":
        for name, value in LONG_DEFAULTS.items():
            if isinstance(value, list) and getattr(args, name) is not None:
                try:
                    items = [x.strip() for x in getattr(args, name).split(",") if x.strip()]
                    setattr(args, name, [type(value[0])(x) for x in items])
                except ValueError:
                    parser.error(f"--{name} {getattr(args, name)!r}: a comma-separated list of {type(value[0]).__name__}")
        for name, stage in (("dense_stage_questions", "first dense stage"), ("extend_questions", "extend stage")):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                parser.error(f"--{name} must be >= 1 (questions a task sample asks in the {stage})")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.command == "long":
        try:
            long_main(args)
            return
        except (FileNotFoundError, RuntimeError, ValueError) as error:
            print(f"ds_mtraining.bench.quality: error: {error}", file=sys.stderr)
            sys.exit(2)
    if args.command == "budget":
        try:
            choice = choose_budget(args.model, json.loads(Path(args.config).read_text()), args.data, args.target,
                                   args.device)
        except (FileNotFoundError, RuntimeError, ValueError) as error:
            print(f"ds_mtraining.bench.quality: error: {error}", file=sys.stderr)
            sys.exit(2)
        write_json(args.out, choice)
        print(json.dumps(choice, indent=2))
        return
    if args.command == "run":
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
    out = Path(args.results) if args.results else study
    out.mkdir(parents=True, exist_ok=True)
    results["plots"] = plot(results, out, tag)
    rows = [{"mode": mode, **{k: r[k] for k in ("heldout_loss", "last_bucket_loss", "passkey_accuracy", "final_density",
                                                "tokens_per_s")}} for mode, r in results["modes"].items()]
    write_result(f"quality_{tag}", {"study": str(study), "tag": tag}, rows, path=out / f"quality_{tag}.json",
                 command=" ".join(["python -m ds_mtraining.bench.quality"] + sys.argv[1:]), device=_device_name(),
                 study=str(study), **results)
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
