"""``python -m ds_mtraining.bench.integration``: the user's own training loop with MTraining
(``examples/deepspeed_loop_mtraining.py``, :mod:`ds_mtraining.integration`) against
``ds_mtraining.train`` on the same setting, as tokens/s and their ratio (goal: at least 0.95).

Both launches train the same model preset (random weights, ``--model``, all layers unless
``--layers``) on random tokens of ``--seq_len`` (each side draws its own: the losses are not
compared here; ``tests/test_integration.py`` compares them on the same data) with the same DeepSpeed
JSON (``--config``, default ZeRO-2 + CPU optimizer offload, bf16, activation checkpointing; its
``mtraining`` section, so the same sparse, liger and activation-checkpointing settings), one after
the other on the same GPUs. The memory tools are off in both (``mtraining.memory``: tiled MLP off,
no offload): they run in ``ds_mtraining.train``'s loop only, and the comparison is of the loops, not
of the settings. With ``--density D`` both take the sparse caps that ``bench.e2e --density`` pins
(about D of the causal entries on random weights, whose nearly uniform attention otherwise keeps
almost everything). Each side's step time is the median after ``--warmup`` steps. A launch cut off
by ``--timeout`` after logging steps past the warm-up keeps them (``cut_off`` says so): a long
start-up costs steps, not the comparison.

Writes ``OUT/integration_<tag>.json`` and prints a table.

    python -m ds_mtraining.bench.integration --model qwen2.5-3b --seq_len 131072 --density 0.05 --steps 5 \\
        --out benchmarks/results --tag h200
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from ..distributed.spawn import free_port
from ..record import result_record, write_json
from . import e2e, params_of
from .launch import LaunchTimeout, launcher_env, run_logged

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "deepspeed_loop_mtraining.py"
MEMORY_TOOLS_OFF = {"tiled_mlp": False, "offload_checkpoints": "none"}


def bench_config(base: dict, args) -> dict:
    """The one JSON both launches read."""
    config = json.loads(json.dumps(base))
    section = config["mtraining"]
    section.update(seq_len=args.seq_len, sequence_parallel_size=args.world, model=args.model, memory=MEMORY_TOOLS_OFF)
    if args.density is not None:
        e2e.pin_density(section, args.density, args.seq_len, args.max_vertical)
    if args.layers is not None:
        section["model"] = {"name_or_path": args.model, "config_overrides": {"num_hidden_layers": args.layers}}
    return config


def step_lines(log: str) -> list[dict]:
    """The example's per-step JSON lines (``examples/common.py:report``: step, loss, step_s) in its log."""
    return [json.loads(line) for line in log.splitlines() if line.startswith("{") and '"step_s"' in line]


def launch_example(config: dict, gpus: list | None, world: int, folder: Path, port: int, args) -> dict:
    """The own-loop example through the deepspeed launcher; its median step time after the warm-up."""
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "config.json", config)
    placement = ["--include", "localhost:" + ",".join(map(str, gpus))] if gpus else ["--num_gpus", str(world)]
    command = [sys.executable, "-m", "deepspeed.launcher.runner", *placement, "--master_port", str(port),
               str(EXAMPLE), "--deepspeed_config", str(folder / "config.json"), "--model", args.model,
               "--seq_len", str(args.seq_len), "--steps", str(args.steps), "--seed", str(args.seed),
               *(["--gradient_checkpointing"] if config["mtraining"].get("gradient_checkpointing") else []),
               *(["--layers", str(args.layers)] if args.layers is not None else [])]
    env = launcher_env()
    if not gpus:
        env.setdefault("OMP_NUM_THREADS", "1")
        env["DS_ACCELERATOR"] = "cpu"
    log = folder / "train.log"
    started = time.monotonic()
    cut_off = None
    try:
        run_logged(command, log, env, args.timeout)
    except LaunchTimeout as error:
        cut_off = str(error)
    except RuntimeError as error:
        raise e2e.LaunchFailed("error", str(error)) from None
    steps = step_lines(log.read_text(errors="replace"))
    times = [step["step_s"] for step in steps]
    timed = times[args.warmup:]
    if not timed:
        raise e2e.LaunchFailed("timeout" if cut_off else "error", cut_off or
                               f"{log}: {len(times)} step(s) logged, none after the {args.warmup} warm-up")
    step_s = statistics.median(timed)
    result = {"step_s": step_s, "tokens_per_s": e2e.tokens_per_step(config) / step_s, "step_times_s": times,
              "losses": [step["loss"] for step in steps], "wall_s": time.monotonic() - started, "log": str(log)}
    return {**result, "cut_off": cut_off} if cut_off else result


def launch_train(config: dict, gpus: list | None, world: int, folder: Path, port: int, args) -> dict:
    """``ds_mtraining.train`` through :func:`ds_mtraining.bench.e2e.launch`; cut off by the timeout,
    the steps its metrics logged past the warm-up."""
    try:
        return e2e.launch(config, gpus, world, folder, port, args)
    except e2e.LaunchFailed as error:
        if error.kind != "timeout":
            raise
        try:
            result = e2e.read_run(folder / "run", e2e.tokens_per_step(config), args.warmup, world)
        except (e2e.LaunchFailed, OSError, ValueError):
            raise error from None
        return {**result, "log": str(folder / "train.log"), "cut_off": str(error)}


def compare(args, train_launch=launch_train, example_launch=launch_example) -> dict:
    """Both launches (train first) and the ratio; a side that fails is recorded with its reason."""
    config = bench_config(json.loads(Path(args.config).read_text()), args)
    gpus = None if args.cpu else list(range(args.world))
    logs = Path(args.out) / f"integration_{args.tag}"
    record = result_record("integration", params_of(args), [], device=args.device, command=args.command,
                           config=args.config, model=args.model, layers=args.layers, seq_len=args.seq_len,
                           world=args.world, steps=args.steps, warmup=args.warmup, memory=MEMORY_TOOLS_OFF, sides={})
    for name, launch in (("train", train_launch), ("own_loop", example_launch)):
        print(f"integration: {name} ...", flush=True)
        port, args.port = args.port or free_port(), 0
        try:
            result = launch(config, gpus, args.world, logs / name, port, args)
            record["sides"][name] = result
            print(f"integration:     step {result['step_s']:.2f} s, {result['tokens_per_s']:.0f} tok/s"
                  + (f" (cut off by the timeout after {len(result['step_times_s'])} steps)" if result.get("cut_off")
                     else ""), flush=True)
        except e2e.LaunchFailed as error:
            record["sides"][name] = {"failure": error.kind, "error": str(error)[-2000:]}
            print(f"integration:     failed: {error.kind}: {str(error).splitlines()[0][:200]}", flush=True)
    train, own = (record["sides"][name].get("tokens_per_s") for name in ("train", "own_loop"))
    record["own_loop_over_train"] = own / train if train and own else None
    record["rows"] = [{"side": name, **{key: side.get(key) for key in ("step_s", "tokens_per_s", "failure")}}
                      for name, side in record["sides"].items()]
    path = write_json(Path(args.out) / f"integration_{args.tag}.json", record)
    ratio = record["own_loop_over_train"]
    print(f"integration: own loop / ds_mtraining.train tokens/s = {ratio:.3f}" if ratio is not None
          else "integration: no ratio (a side failed)")
    print(f"integration: results in {path}", flush=True)
    return record


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ds_mtraining.bench.integration",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "ds_configs" / "e2e_zero2_offload_bf16.json"),
                        help="DeepSpeed JSON both launches start from")
    parser.add_argument("--model", default="qwen2.5-3b", help="model preset")
    parser.add_argument("--layers", type=int, default=None, help="override the depth (default: the preset's)")
    parser.add_argument("--seq_len", type=int, default=131072)
    parser.add_argument("--world", type=int, default=1, help="GPUs (sequence-parallel ranks)")
    parser.add_argument("--density", type=float, default=None,
                        help="both sides' sparse caps pinned for about this density on random weights "
                             "(as bench.e2e --density; default: the config's budgets)")
    parser.add_argument("--max_vertical", type=int, default=256, help="vertical cap with --density")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the median")
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds per launch (then killed)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--port", type=int, default=0, help="master port of the first launch (0: a free one)")
    parser.add_argument("--out", default=None, help="results folder (default bench_results/integration-<time>)")
    parser.add_argument("--tag", default=None, help="integration_<tag>.json (default: the device, e.g. h200x1)")
    parser.add_argument("--cpu", action="store_true", help="CPU ranks (gloo) even where GPUs exist")
    return e2e.finish_launch_args(parser, parser.parse_args(argv), "integration", argv)


def main(argv=None):
    return compare(parse_args(argv))


if __name__ == "__main__":
    main()
