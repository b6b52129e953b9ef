"""``python -m ds_mtraining.bench.capacity``: the longest sequence that trains ``--steps`` steps, per
model shape and mode, on ``--world`` GPUs, with the memory settings of ``mtraining.memory``
(:mod:`ds_mtraining.training.memory`: tiled MLP, checkpoint offload, the host check).

Each measurement is one launch of ``ds_mtraining.train`` through :func:`ds_mtraining.bench.e2e.launch`
(the config ``--config``, default ZeRO-2 + CPU optimizer offload, bf16, activation checkpointing,
full depth, random tokens; ``--density D`` pins MTraining's caps as in ``bench.e2e``; ``--memory
JSON`` overrides ``mtraining.memory`` for every launch). Lengths are the ladder of powers of two
and the 1.5x steps between them (128K, 192K, 256K, 384K, 512K, 768K, 1M, 1.5M, ...). The search
starts at ``--starting_len``: up the ladder while launches train (to ``--max_len``), down it
while they do not; a length already in the results file is not launched again, so a study runs
as several short invocations (each within a time limit) and merges into one file.

For each length: peak GPU memory per rank, resident GPU memory between steps, host memory (the
ranks' peak resident set, summed), checkpoints offloaded, step time, tokens/s, density; a launch
that does not train says why (``oom``: GPU memory, or the plan's prediction of it; ``host``: the
host check refused, the plan's own or for the checkpoints the GPU needs offloaded; ``timeout``,
``error``). At the longest length that trained (``max_seq_len``), a breakdown: weights,
gradients, optimizer, checkpoints on the GPU and on the host (analytic, from the run's
``memory_plan.json``), the measured transient (peak less the resident memory and the
checkpoints on the GPU) and the analytic transients of one layer and of the loss, the largest
named. ``--overhead_at S`` also times S with and without the memory tools (tiled MLP off,
no offload) in the same invocation: ``overhead`` = with / without.

Writes ``OUT/capacity_<tag>.json`` (a result record of :mod:`ds_mtraining.record`: ``max_seq_len`` per
model and mode, ``commit`` and ``dirty``) after every launch, and ``OUT/capacity_<tag>.png`` (GPU and host
memory against length per mode).

    python -m ds_mtraining.bench.capacity --models qwen2.5-3b --modes mtraining --density 0.05 \\
        --starting_len 1048576 --out OUT --tag h200x1
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..distributed.spawn import free_port
from ..record import result_record, write_json
from . import e2e, params_of
from .launch import metric_path, read_metric

MODES = ("mtraining", "ulysses", "dense")
FAILURES = ("oom", "host", "timeout", "error")
EXTRA_METRICS = ("resident_memory_gib", "host_peak_rss_gib", "host_rss_gib", "offloaded_gib")
TOOLS_OFF = {"tiled_mlp": False, "offload_checkpoints": "none"}


def ladder(smallest: int, largest: int) -> list[int]:
    """Powers of two and the 1.5x steps between them, from ``smallest`` to ``largest``."""
    rungs, power = [], 1 << 10
    while power <= largest:
        rungs += [power, power * 3 // 2]
        power *= 2
    return [r for r in rungs if smallest <= r <= largest]


def capacity_launch(config: dict, gpus, world: int, folder: Path, port: int, args) -> dict:
    """bench.e2e's launch, plus the memory metrics and the run's memory plan; a host-check
    refusal is a failure of kind "host"."""
    try:
        result = e2e.launch(config, gpus, world, folder, port, args)
    except e2e.LaunchFailed as error:
        for start, kind in (("host memory:", "host"), ("GPU memory:", "oom")):  # the plan's refusal, predicted
            if error.kind == "error" and start in str(error):  # its one line, not the log's tail
                line = next(line for line in str(error).splitlines() if start in line)
                raise e2e.LaunchFailed(kind, line[line.index(start):]) from None
        raise
    run_dir = folder / "run"
    for name in EXTRA_METRICS:
        if metric_path(run_dir, name).is_file():
            result[name] = float(read_metric(run_dir, name)[1][-1])
    plan = run_dir / "memory_plan.json"
    result["plan"] = json.loads(plan.read_text()) if plan.is_file() else None
    return result


def optimizer_alone(result: dict) -> bool:
    """A host-check refusal with no checkpoint offloaded: the CPU optimizer alone does not fit the
    host, at any length."""
    return result.get("failure") == "host" and " 0 offloaded layer checkpoints" in result.get("error", "")


def breakdown(result: dict) -> dict | None:
    """GiB per rank at one length: the analytic resident parts and host parts of its plan, the
    measured transient and the largest analytic transient, and the plan's predicted peaks (GPU,
    host) with the measured ones over them."""
    plan = result.get("plan")
    if not plan:
        return None
    gpu, host = plan["gpu"], plan["host"]
    peak = max(result["peak_memory_gib"]) if result.get("peak_memory_gib") else None
    resident = result.get("resident_memory_gib")
    transient = None if peak is None or resident is None else peak - resident - gpu["checkpoints_gib"]
    largest = max(plan["transients"], key=plan["transients"].get)
    predicted = plan.get("predicted") or {}
    host_peak = result.get("host_peak_rss_gib")

    def over(measured, prediction):
        return measured / prediction if measured and prediction else None
    return {"weights_gib": gpu["weights_gib"], "gradients_gib": gpu["gradients_gib"],
            "optimizer_gpu_gib": gpu["optimizer_gib"], "optimizer_host_gib": host["optimizer_gib"],
            "checkpoints_gpu_gib": gpu["checkpoints_gib"], "checkpoints_host_gib": host["checkpoints_gib"],
            "checkpoint_layers_on_gpu": gpu["checkpoint_layers_on_gpu"], "offloaded_layers": plan["offload_layers"],
            "peak_gib": peak, "resident_measured_gib": resident, "transient_measured_gib": transient,
            "largest_transient_analytic": {"name": largest, "gib": plan["transients"][largest]},
            "transients_analytic_gib": plan["transients"], "host_available_gib": host["available_gib"],
            "host_peak_rss_gib": host_peak, "predicted_gpu_peak_gib": predicted.get("gpu_peak_gib"),
            "predicted_host_peak_gib": predicted.get("host_peak_gib"),
            "gpu_peak_over_predicted": over(peak, predicted.get("gpu_peak_gib")),
            "host_peak_over_predicted": over(host_peak, predicted.get("host_peak_gib"))}


class Capacity:
    """One invocation's search; ``launcher`` trains one config (tests pass a fake)."""

    def __init__(self, args, launcher=capacity_launch):
        self.args, self.launcher = args, launcher
        self.base = json.loads(Path(args.config).read_text())
        if args.memory:
            self.base["mtraining"]["memory"] = {**self.base["mtraining"].get("memory", {}), **args.memory}
        self.out = Path(args.out)
        self.path = self.out / f"capacity_{args.tag}.json"
        self.logs = self.out / f"capacity_{args.tag}"
        self.port = args.port
        self.record = self._earlier()

    def _earlier(self) -> dict:
        if not self.path.is_file():
            return {"models": {}, "invocations": []}
        try:
            record = json.loads(self.path.read_text())
            return {"models": dict(record["models"]), "invocations": list(record["invocations"])}
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise SystemExit(f"capacity: {self.path} is not a results file of this benchmark ({error}); "
                             f"pass another --out or --tag")

    def entry(self, model: str, mode: str) -> dict:
        return self.record["models"].setdefault(model, {}).setdefault(
            mode, {"world": self.args.world, "density_pinned": self.args.density, "lengths": {}})

    def measure(self, model: str, mode: str, seq_len: int, memory: dict | None = None, name: str = "") -> dict:
        """One launch at full depth; the result, or {"fits": False, "failure": kind, "error": ...}."""
        config = e2e.launch_config(self.base, model, mode, seq_len, self.args.world, None, self.args.density,
                                   self.args.max_vertical)
        if memory is not None:
            config["mtraining"]["memory"] = memory
        gpus = None if self.args.cpu else list(range(self.args.world))
        folder = self.logs / f"{model}_{mode}_w{self.args.world}_s{seq_len}{name}"
        port, self.port = self.port or free_port(), 0  # --port for the first launch, then free ones
        self.say(f"{model} {mode} W={self.args.world} S={seq_len}{name} ...")
        try:
            result = self.launcher(config, gpus, self.args.world, folder, port, self.args)
        except e2e.LaunchFailed as error:
            self.say(f"    does not train: {error.kind}: {str(error).splitlines()[0][:200]}")
            return {"fits": False, "failure": error.kind, "error": str(error)[-2000:]}
        predicted = (result.get("plan") or {}).get("predicted") or {}
        self.say(f"    step {result['step_s']:.2f} s, {result['tokens_per_s']:.0f} tok/s, peak GiB "
                 f"{result.get('peak_memory_gib')} (predicted {predicted.get('gpu_peak_gib')}), host peak GiB "
                 f"{result.get('host_peak_rss_gib')} (predicted {predicted.get('host_peak_gib')})")
        return {"fits": True, **{k: v for k, v in result.items() if k not in ("losses",)}}

    def search(self, model: str, mode: str):
        """Up the ladder from --starting_len while launches train, down it while they do not
        (lengths already in the results file are read, not launched)."""
        lengths = self.entry(model, mode)["lengths"]

        def fits(seq_len: int) -> bool:
            if str(seq_len) not in lengths:
                lengths[str(seq_len)] = self.measure(model, mode, seq_len)
                self.save()
            return lengths[str(seq_len)]["fits"]

        rungs = ladder(min(1 << 16, self.args.starting_len), self.args.max_len)
        at = max([i for i, r in enumerate(rungs) if r <= self.args.starting_len], default=0)
        if fits(rungs[at]):
            for seq_len in rungs[at + 1:]:
                if not fits(seq_len):
                    break
        elif not optimizer_alone(lengths[str(rungs[at])]):  # (no shorter length needs less host memory)
            for seq_len in reversed(rungs[:at]):
                if fits(seq_len) or optimizer_alone(lengths[str(seq_len)]):
                    break

    def overhead(self, model: str, mode: str, seq_len: int):
        """``seq_len`` with the memory settings and without the tools, one launch each."""
        entry = self.entry(model, mode)
        with_tools = self.measure(model, mode, seq_len, name="_tools")
        without = self.measure(model, mode, seq_len, memory={**self.base["mtraining"].get("memory", {}), **TOOLS_OFF},
                               name="_no_tools")
        ratio = with_tools["step_s"] / without["step_s"] if with_tools["fits"] and without["fits"] else None
        entry["overhead"] = {"seq_len": seq_len, "with_tools": with_tools, "without_tools": without,
                             "step_ratio": ratio}
        self.say(f"{model} {mode} S={seq_len}: step with the memory tools / without = "
                 + (f"{ratio:.3f}" if ratio else "n/a"))
        self.save()

    def run(self) -> dict:
        for model in self.args.models:
            for mode in self.args.modes:
                if self.args.overhead_at:
                    self.overhead(model, mode, self.args.overhead_at)
                if not self.args.overhead_only:
                    self.search(model, mode)
        record = self.save()
        plot(record, self.path.with_suffix(".png"))
        return record

    def save(self) -> dict:
        for modes in self.record["models"].values():
            for entry in modes.values():
                summarise(entry)
        rows = [{"model": model, "mode": mode, "max_seq_len": entry["max_seq_len"], "limit": entry["limit"]}
                for model, modes in self.record["models"].items() for mode, entry in modes.items()]
        record = result_record("capacity", params_of(self.args), rows, device=self.args.device,
                               command=self.args.command, config=self.args.config, steps=self.args.steps,
                               warmup=self.args.warmup, models=self.record["models"])
        # the file's commit and this invocation's: earlier invocations keep their own
        write_json(self.path, e2e.with_invocations(record, self.record["invocations"]))
        return record

    def say(self, message: str):
        print(f"capacity: {message}", flush=True)


def summarise(entry: dict):
    """``max_seq_len``: the longest length that trained below the shortest that did not (None:
    none trained); ``limit``: why the next rung did not; ``breakdown`` at ``max_seq_len``."""
    lengths = {int(k): v for k, v in entry["lengths"].items()}
    failed = sorted(s for s, v in lengths.items() if not v["fits"])
    fits = [s for s, v in lengths.items() if v["fits"] and (not failed or s < failed[0])]
    entry["max_seq_len"] = max(fits) if fits else None
    above = [s for s in failed if entry["max_seq_len"] is None or s > entry["max_seq_len"]]
    entry["limit"] = ({"seq_len": above[0], "failure": lengths[above[0]]["failure"]} if above else None)
    entry["breakdown"] = breakdown(lengths[entry["max_seq_len"]]) if entry["max_seq_len"] else None


def plot(record: dict, path: Path):
    """Peak GPU memory (solid) and host peak resident memory (dashed) against length, one panel
    per model, one colour per mode, under the GPU's memory and the host memory available (grey
    lines, from the runs' memory plans); the overhead pair as open triangles (down: without the
    memory tools, up: with them); x: a length that did not train, at the top of the panel."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    models = sorted(record["models"])
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    colours = {"mtraining": "tab:blue", "ulysses": "black", "dense": "tab:gray"}
    for ax, model in zip(axes[0], models):
        for mode, entry in sorted(record["models"][model].items()):
            points = sorted((int(s), v) for s, v in entry["lengths"].items())
            trained = [(s, v) for s, v in points if v["fits"] and v.get("peak_memory_gib")]
            colour = colours.get(mode, "tab:green")
            if trained:
                ax.plot([s / 1024 for s, _ in trained], [max(v["peak_memory_gib"]) for _, v in trained], "o-",
                        color=colour, label=f"{mode}: GPU peak")
            host = [(s, v) for s, v in points if v["fits"] and v.get("host_peak_rss_gib")]
            if host:
                ax.plot([s / 1024 for s, _ in host], [v["host_peak_rss_gib"] for _, v in host], "s--",
                        color=colour, label=f"{mode}: host peak RSS")
            for s, v in points:
                if not v["fits"]:
                    ax.annotate(f"x {v['failure']}", (s / 1024, 1), xycoords=("data", "axes fraction"),
                                ha="center", va="top", color=colour, fontsize=8)
            overhead = entry.get("overhead") or {}
            for side, marker, label in (("without_tools", "v", "without the memory tools"),
                                        ("with_tools", "^", "with the tools of --memory")):
                run = overhead.get(side) or {}
                if run.get("fits") and run.get("peak_memory_gib"):
                    ax.plot([overhead["seq_len"] / 1024], [max(run["peak_memory_gib"])], marker, color=colour,
                            fillstyle="none", label=f"{mode}: GPU peak {label}")
        plans = [v["plan"] for entry in record["models"][model].values()
                 for v in [*entry["lengths"].values(), *(entry.get("overhead") or {}).values()]
                 if isinstance(v, dict) and v.get("plan")]
        limits = (("GPU memory", "-", [p.get("gpu_total_gib") for p in plans]),
                  ("host memory available", "--", [p.get("host", {}).get("available_gib") for p in plans]))
        for label, style, values in limits:
            values = [v for v in values if v]
            if values:
                ax.axhline(min(values), linestyle=style, color="tab:gray", linewidth=1,
                           label=f"{label} ({min(values):.1f} GiB)")
        entries = record["models"][model].values()
        lengths = sorted({int(s) for entry in entries for s in entry["lengths"]}
                         | {entry["overhead"]["seq_len"] for entry in entries if entry.get("overhead")})
        ax.set(xscale="log", xlabel="sequence length (tokens)", ylabel="GiB",
               title=f"{model} ({record['device']})")
        ax.set_xticks([n / 1024 for n in lengths], [f"{n // 1024}K" for n in lengths])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ds_mtraining.bench.capacity",
                                     description=" ".join(__doc__.split("\n\n")[0].split()),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default=e2e.DEFAULT_CONFIG, help="DeepSpeed JSON every launch starts from")
    parser.add_argument("--models", nargs="+", default=["qwen2.5-3b"], help="model presets")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["mtraining"],
                        help="mtraining, ulysses (dense SDPA; on one GPU plain SDPA), dense (a full index)")
    parser.add_argument("--world", type=int, default=1, help="GPUs (sequence-parallel ranks) per launch")
    parser.add_argument("--starting_len", type=int, default=262144, help="the search's first length")
    parser.add_argument("--max_len", type=int, default=1 << 21, help="the longest length tried")
    parser.add_argument("--steps", type=int, default=3, help="training steps per launch")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the median")
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds per launch (then killed)")
    parser.add_argument("--density", type=float, default=None, help="MTraining's caps pinned (bench.e2e)")
    parser.add_argument("--max_vertical", type=int, default=256, help="vertical cap with --density")
    parser.add_argument("--memory", type=json.loads, default=None,
                        help="JSON merged into mtraining.memory of every launch, e.g. '{\"offload_checkpoints\": 16}'")
    parser.add_argument("--overhead_at", type=int, default=None, metavar="S",
                        help="also time S with the memory settings and with the tools off (same invocation)")
    parser.add_argument("--overhead_only", action="store_true", help="with --overhead_at: no search")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--port", type=int, default=0,
                        help="master port of the first launch (0: a free one); later launches take free ones")
    parser.add_argument("--out", default=None, help="results folder (default bench_results/capacity-<UTC time>)")
    parser.add_argument("--tag", default=None, help="capacity_<tag>.json (default: the device, e.g. h200x1)")
    parser.add_argument("--cpu", action="store_true", help="CPU ranks (gloo) even where GPUs exist")
    args = parser.parse_args(argv)
    if args.starting_len > args.max_len:
        parser.error(f"--starting_len {args.starting_len} > --max_len {args.max_len}")
    return e2e.finish_launch_args(parser, args, "capacity", argv)


def main(argv=None):
    args = parse_args(argv)
    bench = Capacity(args)
    bench.say(f"{args.device}; models {args.models}, modes {args.modes}, W={args.world}, from {args.starting_len} "
              f"to at most {args.max_len}; writing {bench.path}")
    record = bench.run()
    for model, modes in record["models"].items():
        for mode, entry in modes.items():
            limit = entry["limit"]
            bench.say(f"{model} {mode}: max_seq_len {entry['max_seq_len']}"
                      + (f" ({limit['seq_len']}: {limit['failure']})" if limit else ""))
    print(f"capacity: results in {bench.path}", flush=True)
    return record


if __name__ == "__main__":
    main()
