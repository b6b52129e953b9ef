"""``python -m ds_mtraining.bench.e2e``: whole training steps of MTraining against what users run
today, DeepSpeed-Ulysses, on the same GPUs, and against dense attention on one GPU.

Every number comes from the real training entry point, launched once per measurement
(``deepspeed --include localhost:GPUS --module ds_mtraining.train``) with the DeepSpeed JSON
``--config`` (default ``ds_configs/e2e_zero2_offload_bf16.json``: ZeRO-2 + CPU optimizer offload,
bf16, activation checkpointing), in which only the model and its depth, ``seq_len``, the attention
mode and the sequence-parallel size change. A step is the forward, the chunked sequence-parallel
loss, the backward and the optimizer step, on random token ids over the model's whole vocabulary
(the ``random`` data source). ``step_s`` is the median of the step times that the run logged after
``--warmup`` steps; ``peak_memory_gib`` every rank's peak allocated GPU memory, as logged;
``density`` (MTraining) the median share of causal entries its index computed: a randomly
initialised model's attention is nearly uniform, so top-p keeps almost everything (0.86-0.98 at
256K-512K on two H200s) and MTraining does dense work there; its speedups mean what they say only
with a trained model's attention (``mtraining.model`` a checkpoint directory), or at a stated
density: ``--density D`` pins MTraining's caps so that top-p, which runs to the caps on random
weights, computes about D of the causal entries (:func:`pinned_caps`; the measured density is
reported beside every speedup).

Modes: ``mtraining`` (``attention: "sparse"``, the estimated vertical-slash index on the striped
ring), ``ulysses`` (HF's dense attention under DeepSpeed-Ulysses), ``dense`` (a full index; on one
GPU a dense kernel). The baselines run once per dense kernel of ``--dense_backends``
(:mod:`ds_mtraining.dense_backend`: ``sdpa``, torch's SDPA with its own dispatch, cuDNN's kernel
on an H200; ``fa4``, FlashAttention-4; by default both where FA4 is installed, else SDPA), each
under its own key: ``ulysses`` and ``dense`` with SDPA, ``ulysses_fa4`` and ``dense_fa4`` with FA4
(:func:`result_key`), so every speedup names its baseline. Per model shape and total sequence
length, one row:

* ``mtraining`` and ``ulysses`` on the same W = ``--world`` GPUs; ``speedup`` = Ulysses' step
  time / MTraining's (``speedup_fa4``: Ulysses with FA4's);
* ``single_gpu``: ``mtraining`` and ``dense`` on one GPU, and its ``speedup`` (and ``speedup_fa4``);
* where both modes were timed at two depths, ``per_layer_speedup``: the ratio of one layer's time
  (``per_layer_s``, the slope between the two launches), which leaves out what does not grow with
  depth (embedding, LM head, loss, optimizer: ``fixed_s``, the step less its layers);
* with ``--profile_step``, ``attention_free_s``: the step less its profiled attention kernels
  (sparse, estimator, SDPA), about what it would take if attention cost nothing (at a partial
  depth, extrapolated like the step), and ``speedup_bound``: the baseline's step / MTraining's
  attention-free step, the most that any attention kernel could give this step (kernels that
  overlapped other work are subtracted whole, so the bound errs high).

Model shapes (presets of :mod:`ds_mtraining.training.model`, built from their config with random
weights, nothing downloaded): ``qwen2.5-3b`` (36 layers, hidden 2048, 16/2 heads of 128, MLP 11008,
vocabulary 151936, tied embeddings) and ``llama-3.1-8b`` (32 layers, hidden 4096, 32/8 heads, MLP
14336, vocabulary 128256).

Depth (``--depth`` for the W-GPU pair, ``--single_depth`` for the one-GPU pair): ``full`` times the
model's own N layers; ``partial`` times L_a and L_b layers (``--layers``) of the same shape and
extrapolates per layer, full = t(L_a) + (N - L_a) (t(L_b) - t(L_a)) / (L_b - L_a) (:func:`extrapolate`),
so the embedding, the LM head, the loss and the optimizer count at full size (peak memory likewise);
``auto`` times full depth unless the last full-depth launch of that mode at a shorter length
predicts a launch longer than ``--timeout`` (its step time scaled with S for mtraining, S^2 for the
dense modes) or the full-depth launch runs out of GPU memory or time, and then goes partial; an
integer N times N layers and reports them as measured (no extrapolation). Every result says
``extrapolated`` and lists the launches behind it (``runs``).

    python -m ds_mtraining.bench.e2e --out OUT --tag h200x2
    python -m ds_mtraining.bench.e2e --models qwen2.5-3b --seq_lens 262144 --parts single --single_depth 4 \\
        --out OUT --tag h200x2
    python -m ds_mtraining.bench.e2e --smoke      # CPU: a tiny model, 2 gloo ranks, end to end

Writes ``OUT/e2e_<tag>.json`` after every measurement, so a run cut off keeps what it measured
(and ``OUT/e2e_<tag>.png``, step time against length per mode, at the end);
rows of other (model, seq_len, world) already in the file are kept and a row measured again is
updated mode by mode (``--modes``), so several short invocations fill one file. The launches' configs and logs
go to ``OUT/e2e_<tag>/``. A table is printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ..config import SparseConfig, slash_cap_for_blocks
from ..training.profile import ATTENTION_KINDS
from ..distributed.spawn import free_port
from ..record import result_record, write_json
from . import fresh_output_dir, params_of
from .launch import LaunchTimeout, launcher_env, metric_path, read_metric, run_logged, training_command

MODES = {"mtraining": "sparse", "ulysses": "ulysses", "dense": "dense"}
QUADRATIC = ("ulysses", "dense")  # dense attention: step time grows with S^2 (MTraining's about with S)
BASELINE_BACKENDS = ("sdpa", "fa4")  # the baselines' dense kernels (ds_mtraining.dense_backend)
MODELS = ("qwen2.5-3b", "llama-3.1-8b")
PARTS = ("sp", "single")  # the W-GPU pair (mtraining vs ulysses) and the one-GPU pair (mtraining vs dense)
DEFAULT_CONFIG = "ds_configs/e2e_zero2_offload_bf16.json"
SMOKE = dict(config="ds_configs/cpu_demo.json", models=["tiny-qwen2"], seq_lens=[512], world=2, steps=2,
             warmup=1, layers=[1, 2], depth="full", single_depth="full", timeout=180.0)
PROFILE_TOP = 10  # kernels of the profiled step copied into the results
OUT_OF_MEMORY = re.compile(r"CUDA out of memory|OutOfMemoryError|out of memory", re.IGNORECASE)


def result_key(mode: str, backend: str = "sdpa") -> str:
    """Where a mode's result goes in a row: ``mode`` for MTraining and the SDPA baselines (as in
    every earlier results file), ``<mode>_<backend>`` for another dense kernel (``dense_fa4``)."""
    return mode if mode not in QUADRATIC or backend == "sdpa" else f"{mode}_{backend}"


def default_dense_backends(cpu: bool) -> list:
    """``--dense_backends``' default: SDPA, and FA4 beside it where its package is installed here
    (looked up, not imported: importing loads the CuTe DSL's libraries)."""
    import importlib.util
    try:
        fa4 = not cpu and importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):  # flash_attn missing, or a broken install
        fa4 = False
    return ["sdpa", "fa4"] if fa4 else ["sdpa"]


class LaunchFailed(RuntimeError):
    """A launch that did not finish: ``kind`` is "timeout", "oom" or "error"."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def fit_layers(value_a: float, value_b: float, layers_a: int, layers_b: int) -> tuple[float, float]:
    """(intercept, slope) of the line through (``layers_a``, ``value_a``) and (``layers_b``,
    ``value_b``): what is not per layer (embedding, LM head, loss, optimizer of those) is the
    intercept, each layer adds the slope."""
    if layers_a == layers_b:
        raise ValueError(f"extrapolation needs two different depths, got {layers_a} twice")
    slope = (value_b - value_a) / (layers_b - layers_a)
    return value_a - layers_a * slope, slope


def extrapolate(value_a: float, value_b: float, layers_a: int, layers_b: int, layers: int) -> float:
    """The value at ``layers`` layers on the line of :func:`fit_layers`."""
    intercept, slope = fit_layers(value_a, value_b, layers_a, layers_b)
    return intercept + layers * slope


def depth_arg(text: str):
    """``--depth``/``--single_depth``: auto | full | partial | a number of layers."""
    if text.isdigit() and int(text) > 0:
        return int(text)
    if text in ("auto", "full", "partial"):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: give auto, full, partial or a positive number of layers")


def model_layers(spec) -> int:
    from ds_mtraining.training.model import model_config
    spec = {"name_or_path": spec, "config_overrides": {}} if isinstance(spec, str) else spec
    return model_config(spec).num_hidden_layers


def launch_config(base: dict, model: str, mode: str, seq_len: int, world: int, layers: int | None,
                  density: float | None = None, max_vertical: int = 256, keep_output: bool = False,
                  dense_backend: str | None = None) -> dict:
    """``base`` with this measurement's model (``layers`` deep, None: its own depth), length, mode
    and sequence-parallel size, on random tokens. With ``density`` (MTraining only), the sparse
    caps that give about that density on a randomly initialised model (:func:`pinned_caps`); with
    ``keep_output`` (MTraining only), ``keep_attention_output`` (attention once per layer under
    checkpointing). The baselines never keep outputs (Ulysses' SDPA recomputes as users run it);
    ``dense_backend`` (the baselines only) is their dense kernel."""
    config = json.loads(json.dumps(base))
    section = config["mtraining"]
    if dense_backend is not None and mode in QUADRATIC:
        section["dense_backend"] = dense_backend
    section.pop("keep_attention_output", None)
    if keep_output and mode == "mtraining":
        section["keep_attention_output"] = True
    if density is not None and mode == "mtraining":
        pin_density(section, density, seq_len, max_vertical)
    given = section.get("model")
    overrides = dict(given.get("config_overrides", {})) if isinstance(given, dict) and \
        given.get("name_or_path") == model else {}
    overrides.pop("num_hidden_layers", None)  # the depth is the measurement's: the preset's own, or ``layers``
    if layers is not None:
        overrides["num_hidden_layers"] = layers
    section.update(seq_len=seq_len, sequence_parallel_size=world, attention=MODES[mode],
                   model={"name_or_path": model, "config_overrides": overrides}, data={"source": "random"})
    section.pop("static", None)
    return config


def pinned_caps(density: float, seq_len: int, block_size: int, max_vertical: int) -> dict:
    """The sparse caps for about ``density`` of the causal entries on random weights: their
    nearly uniform attention makes top-p run to the caps, so the slash cap (block diagonals, the
    bulk of the work) sets the density; ``max_vertical`` columns add max_vertical / (S / 2)."""
    blocks = max(1, round(density * seq_len / block_size))
    return {"max_slash_diagonals": slash_cap_for_blocks(blocks), "max_vertical": max_vertical}


def pin_density(section: dict, density: float, seq_len: int, max_vertical: int):
    """Puts :func:`pinned_caps` for ``density`` into an ``mtraining`` section's ``sparse`` settings,
    at the section's stripe block."""
    block = section.get("stripe_block", SparseConfig.block_size)
    section["sparse"] = {**section.get("sparse", {}), **pinned_caps(density, seq_len, block, max_vertical)}


def tokens_per_step(config: dict) -> int:
    """Tokens one optimizer step of a launch trains on each data-parallel replica."""
    return (config.get("train_micro_batch_size_per_gpu", 1) * config.get("gradient_accumulation_steps", 1)
            * config["mtraining"]["seq_len"])


def read_run(run_dir: Path, tokens_per_step: int, warmup: int, world: int, profiled_step: int = 0) -> dict:
    """Step times, tokens/s, peak memory per rank, losses and (sparse runs) the attention density
    of a finished run; the median step time leaves out the warm-up steps and the profiled one."""
    def metric(name: str) -> list[float]:
        return read_metric(run_dir, name)[1].tolist() if metric_path(run_dir, name).is_file() else []

    steps = [tokens_per_step / rate for rate in metric("tokens_per_s")]
    timed = [s for number, s in enumerate(steps, start=1) if number > warmup and number != profiled_step]
    if not timed:
        raise LaunchFailed("error", f"{run_dir}: {len(steps)} logged step(s), none after the {warmup} warmup step(s)"
                                    + (f" other than the profiled step {profiled_step}" if profiled_step else ""))
    step_s = statistics.median(timed)
    peaks = [metric(f"peak_memory_gib_rank{r}") for r in range(world)]
    density = metric("density")[warmup:]
    return {"step_s": step_s, "tokens_per_s": tokens_per_step / step_s, "step_times_s": steps,
            "peak_memory_gib": [p[-1] for p in peaks] if all(peaks) else None,
            "density": statistics.median(density) if density else None, "losses": metric("loss")}


def launch(config: dict, gpus: list | None, world: int, folder: Path, port: int, args) -> dict:
    """Trains ``config`` for ``args.steps`` steps through the deepspeed launcher on ``gpus`` (None:
    ``world`` CPU ranks) within ``args.timeout`` seconds (then the launch's process group is killed);
    returns :func:`read_run`'s numbers and the wall time."""
    folder.mkdir(parents=True, exist_ok=True)
    monitor = {"enabled": True, "output_path": str(folder / "run" / "metrics"), "job_name": "mtraining"}
    config = {**config, "csv_monitor": monitor}  # where read_run looks, whatever --config says
    write_json(folder / "config.json", config)
    devices = ",".join(f"cuda:{gpu}" for gpu in gpus) if gpus else ",".join(["cpu"] * world)
    profile = ("--profile_step", str(args.profile_step)) if args.profile_step else ()
    command = training_command(folder / "config.json", args.steps, folder / "run", devices, port, args.seed, 1,
                               extra=("--no_checkpoint", *profile))
    env = launcher_env()
    if not gpus:
        env.setdefault("OMP_NUM_THREADS", "1")  # CPU ranks outnumber small machines' cores
    log = folder / "train.log"
    started = time.monotonic()
    try:
        run_logged(command, log, env, args.timeout)
    except LaunchTimeout as error:
        raise LaunchFailed("timeout", str(error)) from None
    except RuntimeError as error:
        raise LaunchFailed("oom" if OUT_OF_MEMORY.search(log.read_text(errors="replace")) else "error",
                           str(error)) from None
    wall = time.monotonic() - started
    result = read_run(folder / "run", tokens_per_step(config), args.warmup, world, args.profile_step)
    startup = folder / "run" / "startup.json"  # (train.py's start-up phases: a 3B model takes minutes)
    if startup.is_file():
        result["startup_s"] = json.loads(startup.read_text())
    profile_path = folder / "run" / f"profile_step{args.profile_step}_rank0.json"
    if args.profile_step and profile_path.is_file():  # rank 0's step time by kind of work, its top kernels
        profile = json.loads(profile_path.read_text())
        result["profile_ms_by_kind"] = profile["ms_by_kind"]
        result["profile_top"] = profile["top"][:PROFILE_TOP]
        result["attention_free_s"] = attention_free_step(result["step_s"], profile["ms_by_kind"])
    return {**result, "wall_s": wall, "log": str(log)}


def attention_free_step(step_s: float, ms_by_kind: dict) -> float | None:
    """``step_s`` less the attention kernels' time of the profiled step (``ATTENTION_KINDS``); None
    when that leaves nothing (a profile that does not describe this step)."""
    rest = step_s - sum(ms_by_kind.get(kind, 0.0) for kind in ATTENTION_KINDS) / 1e3
    return rest if rest > 0 else None


def speedup(slow: dict | None, fast: dict | None, key: str = "step_s") -> float | None:
    """slow[key] / fast[key]; ``key="per_layer_s"``: the ratio of one layer's time (the slope
    between the two partial launches), without the embedding, LM head, loss and optimizer."""
    if not slow or not fast or not slow.get(key) or not fast.get(key):
        return None
    return slow[key] / fast[key]


def speedup_bound(slow: dict | None, fast: dict | None) -> float | None:
    """slow's step / fast's attention-free step: what no attention kernel in ``fast`` can pass."""
    if not slow or not fast or not slow.get("step_s") or not fast.get("attention_free_s"):
        return None
    return slow["step_s"] / fast["attention_free_s"]


class Bench:
    """The measurements of one invocation; ``launcher`` runs one training launch (tests pass a fake)."""

    def __init__(self, args, launcher=launch):
        self.args, self.launcher = args, launcher
        self.base = json.loads(Path(args.config).read_text())
        if args.liger is not None:  # every launch, MTraining and the baselines alike
            self.base["mtraining"]["liger"] = {"auto": "auto", "on": True, "off": False}[args.liger]
        self.out = Path(args.out)
        self.path = self.out / f"e2e_{args.tag}.json"
        self.logs = self.out / f"e2e_{args.tag}"
        self.cpu = args.cpu
        self.port = args.port
        self.history: dict = {}  # (model, result key, world) -> (seq_len, step_s, launch overhead s) at full depth
        self.earlier = self._earlier()
        self.rows: dict = {}

    # ------------------------------------------------------------------ launches
    def _earlier(self) -> dict:
        if not self.path.is_file():
            return {"rows": [], "invocations": []}
        try:
            record = json.loads(self.path.read_text())
            return {"rows": list(record["rows"]), "invocations": list(record.get("invocations", []))}
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise SystemExit(f"e2e: {self.path} is not a results file of this benchmark ({error}); "
                             f"pass another --out or --tag")

    def _launch(self, model: str, mode: str, backend: str, seq_len: int, world: int, layers: int, full: int) -> dict:
        config = launch_config(self.base, model, mode, seq_len, world, None if layers == full else layers,
                               self.args.density, self.args.max_vertical, self.args.keep_attention_output, backend)
        gpus = None if self.cpu else (self.args.gpus[:world] if world > 1 else [self.args.single_gpu])
        key = result_key(mode, backend)
        folder = self.logs / f"{model}_{key}_w{world}_s{seq_len}_l{layers}"
        port, self.port = self.port or free_port(), 0  # --port for the first launch, then free ones
        self.say(f"{model} {key} W={world} S={seq_len} {layers} layers ...")
        result = self.launcher(config, gpus, world, folder, port, self.args)
        self.say(f"    step {result['step_s']:.3f} s, {result['tokens_per_s']:.0f} tok/s, peak GiB "
                 f"{result['peak_memory_gib']}, launch {result['wall_s']:.0f} s")
        return {"layers": layers, **result}

    def _predicted_s(self, model: str, mode: str, backend: str, world: int, seq_len: int) -> float | None:
        earlier = self.history.get((model, result_key(mode, backend), world))
        if earlier is None:
            return None
        shorter, step_s, overhead = earlier
        growth = (seq_len / shorter) ** (2 if mode in QUADRATIC else 1)
        return overhead + self.args.steps * step_s * growth

    def measure(self, model: str, mode: str, seq_len: int, world: int, depth, backend: str = "sdpa") -> dict:
        """One mode (a baseline: with the dense kernel ``backend``) at one length on ``world`` GPUs,
        at the depth ``depth`` asks for."""
        full = model_layers(model)
        out = {"mode": mode, "attention": MODES[mode], "world": world, "model_layers": full}
        if mode in QUADRATIC:
            out["dense_backend"] = backend
        try:
            if isinstance(depth, int):
                run = self._launch(model, mode, backend, seq_len, world, depth, full)
                return {**out, **self._measured(run, depth), "extrapolated": False, "runs": [run]}
            predicted = self._predicted_s(model, mode, backend, world, seq_len) if depth == "auto" else None
            if depth in ("full", "auto") and (predicted is None or predicted <= self.args.timeout):
                try:
                    run = self._launch(model, mode, backend, seq_len, world, full, full)
                    self.history[(model, result_key(mode, backend), world)] = (
                        seq_len, run["step_s"], run["wall_s"] - sum(run["step_times_s"]))
                    return {**out, **self._measured(run, full), "extrapolated": False, "runs": [run]}
                except LaunchFailed as error:
                    if depth == "full" or error.kind == "error":
                        raise
                    out["full_depth"] = f"{error.kind}: {error}"
                    self.say(f"    {error.kind} at full depth: timing {self.args.layers} layers instead")
            elif depth == "auto":
                out["full_depth"] = (f"skipped: a launch at full depth predicted {predicted:.0f} s > --timeout "
                                     f"{self.args.timeout:.0f} s")
                self.say(f"{model} {mode} W={world} S={seq_len}: {out['full_depth']}")
            return {**out, **self._partial(model, mode, backend, seq_len, world, full)}
        except LaunchFailed as error:
            self.say(f"    failed: {error.kind}: {str(error).splitlines()[0]}")
            return {**out, "step_s": None, "error": f"{error.kind}: {error}"}

    @staticmethod
    def _measured(run: dict, layers: int) -> dict:
        return {"layers": layers, "step_s": run["step_s"], "tokens_per_s": run["tokens_per_s"],
                "peak_memory_gib": run["peak_memory_gib"], "density": run["density"],
                "attention_free_s": run.get("attention_free_s")}

    def _partial(self, model: str, mode: str, backend: str, seq_len: int, world: int, full: int) -> dict:
        """Times ``--layers`` L_a and L_b and extrapolates step time and peak memory to ``full``."""
        layers_a, layers_b = self.args.layers
        a, b = (self._launch(model, mode, backend, seq_len, world, layers, full) for layers in (layers_a, layers_b))
        fixed, per_layer = fit_layers(a["step_s"], b["step_s"], layers_a, layers_b)
        step_s = fixed + full * per_layer
        peak = None
        if a["peak_memory_gib"] and b["peak_memory_gib"]:
            peak = [extrapolate(x, y, layers_a, layers_b, full) for x, y in zip(a["peak_memory_gib"], b["peak_memory_gib"])]
        free = None
        if a.get("attention_free_s") and b.get("attention_free_s"):
            free = extrapolate(a["attention_free_s"], b["attention_free_s"], layers_a, layers_b, full)
        return {"layers": full, "step_s": step_s, "tokens_per_s": a["tokens_per_s"] * a["step_s"] / step_s,
                "peak_memory_gib": peak, "density": b["density"], "extrapolated": True,
                "per_layer_s": per_layer, "fixed_s": fixed, "attention_free_s": free, "runs": [a, b]}

    # ------------------------------------------------------------------ rows
    def _launched(self, modes: tuple) -> list:
        """(mode, backend) of every launch of a part: MTraining once, its baseline per dense kernel."""
        return [(mode, backend) for mode in modes if mode in self.args.modes
                for backend in (self.args.dense_backends if mode in QUADRATIC else ["sdpa"])]

    def run(self):
        args = self.args
        for model in args.models:
            for seq_len in args.seq_lens:
                row = self.rows.setdefault((model, seq_len, args.world),
                                           {"model": model, "seq_len": seq_len, "world": args.world})
                if "sp" in args.parts:
                    for mode, backend in self._launched(("mtraining", "ulysses")):
                        row[result_key(mode, backend)] = self.measure(model, mode, seq_len, args.world, args.depth,
                                                                      backend)
                        self.save()
                if "single" in args.parts:
                    single = row.setdefault("single_gpu", {})
                    for mode, backend in self._launched(("mtraining", "dense")):
                        single[result_key(mode, backend)] = self.measure(model, mode, seq_len, 1, args.single_depth,
                                                                         backend)
                        self.save()
        record = self.save()
        plot(record, self.path.with_suffix(".png"))
        return record

    def rows_merged(self) -> list:
        """This invocation's rows over the file's earlier ones (by model, seq_len, world; mode by mode)."""
        merged = {(r["model"], r["seq_len"], r["world"]): dict(r) for r in self.earlier["rows"]}
        for key, row in self.rows.items():
            earlier = merged.get(key, {})
            merged[key] = {**earlier, **row}
            if "single_gpu" in row:  # mode by mode: --modes may have launched only some
                merged[key]["single_gpu"] = {**earlier.get("single_gpu", {}), **row["single_gpu"]}
        for row in merged.values():
            add_speedups(row, "ulysses")
            if row.get("single_gpu"):
                add_speedups(row["single_gpu"], "dense")
            row["extrapolated"] = sorted(name for name, result in _results(row) if result.get("extrapolated"))
        return sorted(merged.values(), key=lambda r: (r["model"], r["seq_len"], r["world"]))

    def save(self) -> dict:
        record = result_record("e2e", params_of(self.args), self.rows_merged(), device=self.args.device,
                               command=self.args.command, config=self.args.config, steps=self.args.steps,
                               warmup=self.args.warmup, partial_layers=self.args.layers)
        write_json(self.path, with_invocations(record, self.earlier["invocations"]))  # a killed run keeps the last
        return record

    def say(self, message: str):
        print(f"e2e: {message}", flush=True)


def with_invocations(record: dict, earlier: list) -> dict:
    """``record`` (:func:`ds_mtraining.record.result_record`) with ``invocations``: the results
    file's ``earlier`` ones and this one (its utc, device, command, commit and dirty), where several
    invocations fill one file (e2e, capacity)."""
    record["invocations"] = earlier + [{key: record[key] for key in ("utc", "device", "command", "commit", "dirty")}]
    return record


def add_speedups(part: dict, baseline: str):
    """MTraining's ratios in ``part`` (a row, or its ``single_gpu``) against each dense kernel's
    ``baseline`` measured there: ``speedup``, ``per_layer_speedup`` and ``speedup_bound``, with
    ``_<backend>`` after the name for a kernel other than SDPA (``speedup_fa4``)."""
    for backend in BASELINE_BACKENDS:
        key = result_key(baseline, backend)
        if backend != "sdpa" and key not in part:
            continue
        suffix = key[len(baseline):]
        slow, fast = part.get(key), part.get("mtraining")
        part["speedup" + suffix] = speedup(slow, fast)
        part["per_layer_speedup" + suffix] = speedup(slow, fast, "per_layer_s")
        part["speedup_bound" + suffix] = speedup_bound(slow, fast)


def _results(row: dict):
    """(name, result) of every mode measured in a row."""
    for part, prefix in ((row, ""), (row.get("single_gpu", {}), "single_gpu.")):
        for key, result in part.items():
            if isinstance(result, dict) and "mode" in result:
                yield prefix + key, result


# ----------------------------------------------------------------------------- output
def table(record: dict):
    """A rich table of the rows: step seconds (* = extrapolated per layer), the largest rank's peak
    GiB, and the speedups."""
    from rich.table import Table
    world = ", ".join(sorted({str(r["world"]) for r in record["rows"]}))
    grid = Table(title=f"e2e: training step, {record['device']} (W = {world}; * = extrapolated per layer; "
                       f"x/layer: one layer's time, from the two partial launches; <= x: the bound with "
                       f"attention free, from the profiled step)")
    kernels = [backend for backend in BASELINE_BACKENDS  # the dense kernels some row has a baseline of
               if any(result_key(mode, backend) in part for row in record["rows"]
                      for mode, part in (("ulysses", row), ("dense", row.get("single_gpu", {}))))] or ["sdpa"]
    named = lambda name, backend: name if backend == "sdpa" else f"{name} ({backend.upper()})"  # noqa: E731
    columns = ["model", "seq_len", "MTraining W"]
    columns += [c for b in kernels for c in (named("Ulysses W", b), named("speedup", b))]
    columns += ["MTraining 1 GPU"] + [c for b in kernels for c in (named("dense 1 GPU", b), named("speedup 1 GPU", b))]
    for name in columns:
        grid.add_column(name, justify="left" if name == "model" else "right")

    def cell(result):
        if not isinstance(result, dict):
            return "-"
        if not result.get("step_s"):
            return f"[red]{result.get('error', 'failed').split(':')[0]}"
        peak, density = result.get("peak_memory_gib"), result.get("density")
        memory = f", {max(peak):.0f} GiB" if peak else ""
        sparse = f", density {density:.2f}" if density is not None else ""
        return f"{result['step_s']:.2f} s{'*' if result.get('extrapolated') else ''}{memory}{sparse}"

    def ratio(value, per_layer=None, bound=None):
        return ((f"{value:.1f}x" if value else "-") + (f" ({per_layer:.1f}x/layer)" if per_layer else "")
                + (f" (<= {bound:.1f}x)" if bound else ""))
    def baselines(part: dict, mode: str):
        for backend in kernels:
            suffix = result_key(mode, backend)[len(mode):]
            yield cell(part.get(mode + suffix))
            yield ratio(part.get("speedup" + suffix), part.get("per_layer_speedup" + suffix),
                        part.get("speedup_bound" + suffix))
    for row in record["rows"]:
        single = row.get("single_gpu", {})
        length = row["seq_len"]
        grid.add_row(row["model"], f"{length // 1024}K" if length % 1024 == 0 else str(length),
                     cell(row.get("mtraining")), *baselines(row, "ulysses"),
                     cell(single.get("mtraining")), *baselines(single, "dense"))
    return grid


PLOTTED = (("mtraining", None, "MTraining, W GPUs", "tab:blue", "-"),
           ("ulysses", None, "Ulysses (SDPA), W GPUs", "black", "-"),
           ("ulysses_fa4", None, "Ulysses (FA4), W GPUs", "tab:red", "-"),
           ("single_gpu", "mtraining", "MTraining, 1 GPU", "tab:blue", ":"),
           ("single_gpu", "dense", "dense (SDPA), 1 GPU", "black", ":"),
           ("single_gpu", "dense_fa4", "dense (FA4), 1 GPU", "tab:red", ":"))


def plot(record: dict, path: Path):
    """Step seconds against seq_len (log-log), one panel per model: every mode measured, hollow
    markers where extrapolated per layer, each W-GPU speedup written above MTraining's point."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    models = sorted({row["model"] for row in record["rows"]})
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [row for row in record["rows"] if row["model"] == model]
        for key, sub, label, color, style in PLOTTED:
            points = [(row["seq_len"] / 1024, (row.get(key) or {}).get(sub) if sub else row.get(key)) for row in rows]
            points = [(x, r) for x, r in points if isinstance(r, dict) and r.get("step_s")]
            if not points:
                continue
            ax.plot([x for x, _ in points], [r["step_s"] for _, r in points], style, color=color, label=label)
            for x, r in points:
                ax.plot(x, r["step_s"], "o", color=color, mfc="white" if r.get("extrapolated") else color)
        for row in rows:  # the W-GPU speedup, halfway (on the log scale) between the two steps
            if row.get("speedup") and (row.get("mtraining") or {}).get("step_s"):
                middle = row["mtraining"]["step_s"] * row["speedup"] ** 0.5
                ax.annotate(f"{row['speedup']:.1f}x", (row["seq_len"] / 1024, middle), ha="center", fontsize=9)
        lengths = sorted({row["seq_len"] for row in rows})
        ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens)", ylabel="training step (s)",
               title=f"{model} ({record['device']}; hollow: extrapolated per layer)")
        ax.set_xticks([n / 1024 for n in lengths], [f"{n // 1024}K" for n in lengths])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def device_name(cpu: bool) -> str:
    """The GPU model and count from nvidia-smi (no CUDA context in this process), else the CPU."""
    if not cpu:
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=30).stdout.split("\n")
            names = [n.strip() for n in names if n.strip()]
            if names:
                return f"{len(names)}x {names[0]}"
        except (OSError, subprocess.SubprocessError):
            pass
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def device_tag(device: str, cpu: bool, world: int) -> str:
    """'2x NVIDIA H200' -> 'h200x2' (the GPU model and W), 'cpu' on CPU."""
    if cpu:
        return "cpu"
    words = device.split("x ", 1)[-1].lower().replace("nvidia", "").split()
    return (re.sub(r"[^a-z0-9]", "", words[0]) if words else "gpu") + f"x{world}"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ds_mtraining.bench.e2e",
                                     description=" ".join(__doc__.split("\n\n")[0].split()),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="DeepSpeed JSON every launch starts from")
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="model presets")
    parser.add_argument("--seq_lens", type=int, nargs="+", default=[131072, 262144, 524288], help="total tokens")
    parser.add_argument("--world", type=int, default=2, help="GPUs of the MTraining vs Ulysses pair")
    parser.add_argument("--gpus", type=int, nargs="+", default=None, help="their ids (default 0 .. world-1)")
    parser.add_argument("--single_gpu", type=int, default=0, help="the GPU of the one-GPU pair")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="sp: MTraining vs Ulysses on W GPUs; single: MTraining vs dense on one GPU")
    parser.add_argument("--depth", type=depth_arg, default="auto", help="auto | full | partial | N layers (W GPUs)")
    parser.add_argument("--single_depth", type=depth_arg, default="auto", help="the same for the one-GPU pair")
    parser.add_argument("--layers", type=int, nargs=2, default=[2, 4], metavar=("L_A", "L_B"),
                        help="the two depths timed for a per-layer extrapolation")
    parser.add_argument("--steps", type=int, default=3, help="training steps per launch")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the median")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch (then killed)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--port", type=int, default=0,
                        help="master port of the first launch (0: a free one); later launches take free ones")
    parser.add_argument("--out", default=None, help="results folder (default bench_results/e2e-<time>)")
    parser.add_argument("--tag", default=None, help="e2e_<tag>.json (default: the device, e.g. h200x2, or cpu)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"CPU end-to-end check at tiny sizes (2 gloo ranks): {SMOKE}, unless given")
    parser.add_argument("--cpu", action="store_true", help="CPU ranks (gloo) even where GPUs exist")
    parser.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES),
                        help="the modes to launch (e.g. mtraining alone for a long full-depth run)")
    parser.add_argument("--density", type=float, default=None,
                        help="MTraining's sparse caps pinned for about this density on random weights "
                             "(default: the config's budgets, which keep nearly everything there)")
    parser.add_argument("--max_vertical", type=int, default=256, help="vertical cap with --density")
    parser.add_argument("--profile_step", type=int, default=0, metavar="N",
                        help="every launch profiles its step N (train.py --profile_step; give one more "
                             "step, it is left out of the median); each run then reports rank 0's time by "
                             "kind of work (profile_ms_by_kind) and its 10 costliest kernels (profile_top)")
    parser.add_argument("--keep_attention_output", action="store_true",
                        help="MTraining launches keep each layer's attention output for the recompute "
                             "(mtraining.keep_attention_output: attention once per layer and step)")
    parser.add_argument("--dense_backends", nargs="+", choices=BASELINE_BACKENDS, default=None,
                        help="the baselines' dense kernels, one launch each (mtraining.dense_backend; "
                             "default: sdpa, and fa4 beside it where flash-attn-4 is installed)")
    parser.add_argument("--liger", choices=("auto", "on", "off"), default=None,
                        help="mtraining.liger of every launch (liger-kernel's RMSNorm/RoPE/SwiGLU; default: "
                             "the config's); run once with each, under two --tag, to measure them")
    given = set()
    for item in argv if argv is not None else sys.argv[1:]:
        if item.startswith("--"):
            given.add(item[2:].split("=")[0])
    args = parser.parse_args(argv)
    if args.smoke:
        args.cpu = True
        for name, value in SMOKE.items():
            if name not in given:
                setattr(args, name, value)
    if args.gpus is None:
        args.gpus = list(range(args.world))
    if len(args.gpus) < args.world:
        parser.error(f"--gpus {args.gpus}: need {args.world} ids for --world {args.world}")
    if args.layers[0] == args.layers[1] or min(args.layers) < 1:
        parser.error(f"--layers {args.layers}: two different positive depths")
    if args.smoke and args.tag is None:
        args.tag = "smoke"
    args = finish_launch_args(parser, args, "e2e", argv)
    if args.dense_backends is None:  # (fa4 given where it cannot run: its launches fail with train.py's line why)
        args.dense_backends = default_dense_backends(args.cpu)
    return args


def finish_launch_args(parser, args, name: str, argv):
    """What the launching benchmarks (e2e, capacity, integration) derive from their arguments:
    CPU ranks where no GPU is visible, the warm-up check, the device and its tag, a fresh output
    folder unless ``--out``, and the command line."""
    args.profile_step = getattr(args, "profile_step", 0)  # (what launch reads)
    if not args.cpu:
        import torch
        args.cpu = not torch.cuda.is_available()
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
    args.device = device_name(args.cpu)
    if args.tag is None:
        args.tag = device_tag(args.device, args.cpu, args.world)
    if args.out is None:
        args.out = str(fresh_output_dir(name))
    args.command = " ".join([f"python -m ds_mtraining.bench.{name}", *(argv if argv is not None else sys.argv[1:])])
    return args


def main(argv=None):
    from rich.console import Console
    args = parse_args(argv)
    bench = Bench(args)
    bench.say(f"{args.device}; models {args.models}, seq_lens {args.seq_lens}, W={args.world}, parts {args.parts}, "
              f"depth {args.depth}/{args.single_depth}, baselines' dense kernels {args.dense_backends}; "
              f"writing {bench.path}")
    record = bench.run()
    Console(width=160).print(table(record))
    print(f"e2e: results in {bench.path}", flush=True)
    return record


if __name__ == "__main__":
    main()
