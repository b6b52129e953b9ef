"""``python -m ds_mtraining.eval MODEL_DIR``: passkey retrieval, loss by position, attention
recall and RULER-style tasks of an exported HF causal LM (see :mod:`ds_mtraining.eval`)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..record import write_json
from ..ruler import TASKS as RULER_TASKS
from ..step import new_step

TASKS = ("passkey", "loss", "recall", "ruler")
DEFAULT_TASKS = ("passkey", "loss", "recall")
SAVE_EVERY_S = 10.0  # the RULER trials' file is rewritten (atomically) at most this often, and at the end


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers")
    return values


def _depths(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or not all(0.0 <= d <= 1.0 for d in values):
        raise argparse.ArgumentTypeError(f"{text!r}: depths lie in [0, 1]")
    return values


def _names(text: str, known, what: str = "task") -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    unknown = sorted(set(values) - set(known))
    if unknown or not values:
        raise argparse.ArgumentTypeError(f"unknown {what}(s) {unknown or text!r}; choose from {list(known)}")
    return values


def _tasks(text: str) -> list[str]:
    return _names(text, TASKS)


def _ruler_tasks(text: str) -> list[str]:
    return _names(text, RULER_TASKS, "RULER task")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except where the help text says what None means."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ds_mtraining.eval", formatter_class=_Formatter,
        description="Evaluate an exported HF causal LM (local directory): passkey retrieval over a depth x "
                    "length grid, mean loss by position on held-out text, and the recall/density of "
                    "MTraining's estimated index on the model's own attention. Writes JSON + PNG files.")
    parser.add_argument("model", help="local model directory (config.json + weights, from save_pretrained)")
    parser.add_argument("--tasks", type=_tasks, default=",".join(DEFAULT_TASKS),
                        help="comma-separated subset of " + ",".join(TASKS))
    parser.add_argument("--out", default=None, help="output directory (default: ./eval_results/<timestamp>)")
    parser.add_argument("--attention", choices=("dense", "sparse", "static"), default="dense",
                        help="dense attention (as the paper evaluates), MTraining's sparse prefill (one process), "
                             "or the static baseline's sinks + local window at --static_density")
    parser.add_argument("--static_density", type=float, default=None,
                        help="with --attention static: the static pattern's share of the causal entries (the "
                             "density the model trained at)")
    parser.add_argument("--dense_kernel", choices=("sdpa", "fa4", "auto"), default="sdpa",
                        help="the prefill's kernel under dense attention: SDPA, FlashAttention-4, or auto (FA4 on "
                             "Hopper where it runs, else SDPA: mtraining.dense_backend's rule)")
    parser.add_argument("--sparse_config", default=None,
                        help="estimator settings: a DeepSpeed JSON (its mtraining.sparse) or inline JSON of "
                             "SparseConfig fields; default SparseConfig()")
    parser.add_argument("--lengths", type=_ints, default="1024,2048,4096,8192", help="passkey prompt lengths (tokens)")
    parser.add_argument("--depths", type=_depths, default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1]")
    parser.add_argument("--trials", type=int, default=2, help="random keys per grid cell")
    parser.add_argument("--digits", type=int, default=5, help="digits of the passkey")
    parser.add_argument("--loss_length", type=int, default=None,
                        help="tokens per loss window, the trained length (default: the largest --lengths)")
    parser.add_argument("--loss_lengths", type=_ints, default=None,
                        help="loss by position at each of these lengths too (loss_by_length.json; under sparse "
                             "attention with each layer's index density); lengths already in the file are kept")
    parser.add_argument("--loss_windows", type=int, default=4, help="held-out windows for the loss")
    parser.add_argument("--buckets", type=int, default=16, help="position buckets of the loss")
    parser.add_argument("--recall_length", type=int, default=None,
                        help="tokens of the recall sequence (default: the largest --lengths)")
    parser.add_argument("--ruler_tasks", type=_ruler_tasks, default=",".join(RULER_TASKS),
                        help="RULER-style tasks of --tasks ruler (ds_mtraining.ruler), at --ruler_lengths x --depths, "
                             "--trials per depth per round")
    parser.add_argument("--ruler_lengths", type=_ints, default=None, help="prompt lengths of the tasks "
                                                                          "(default: --lengths)")
    parser.add_argument("--target_width", type=float, default=0.04,
                        help="more rounds of a task at a length until its 95%% interval is narrower than this")
    parser.add_argument("--max_trials", type=int, default=None,
                        help="trials of a task at a length at most (whole rounds; default: one round)")
    parser.add_argument("--time_budget", type=float, default=None,
                        help="seconds: the loss lengths and the tasks stop when they are spent (the tasks' "
                             "trials so far are kept in ruler_trials.json; the same --out continues them)")
    parser.add_argument("--data", default="stdlib",
                        help="held-out text: 'stdlib', a saved dataset dir, or comma-separated files (the last "
                             "documents are used)")
    parser.add_argument("--tokenizer", default="auto", help="'auto' (the model dir's, else bytes), 'bytes' or a dir")
    parser.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cpu', 'cuda', 'cuda:1'")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="model dtype (auto: bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the keys and filler offsets")
    parser.add_argument("--no_progress", action="store_true", default=None, help="no progress bar")
    return parser


def check_args(parser, args):
    for name in ("trials", "digits", "loss_windows", "buckets"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    args.loss_length = args.loss_length or max(args.lengths)
    args.recall_length = args.recall_length or max(args.lengths)
    args.ruler_lengths = args.ruler_lengths or args.lengths
    if args.max_trials is not None and args.max_trials < 1 or not 0 < args.target_width <= 1:
        parser.error("--max_trials must be >= 1 and --target_width lie in (0, 1]")
    if (args.attention == "static") != (args.static_density is not None):
        parser.error("--attention static and --static_density (the density the model trained at) go together")
    if args.attention in ("sparse", "static"):
        from .runtime import sparse_config
        block = sparse_config(args.sparse_config).block_size
        lengths = {"--lengths": args.lengths, "--loss_length": [args.loss_length],
                   "--loss_lengths": args.loss_lengths or [], "--ruler_lengths": args.ruler_lengths}
        for flag, values in lengths.items():
            bad = [n for n in values if n % block]
            if bad:
                parser.error(f"{flag} {bad}: {args.attention} attention needs multiples of the block size {block}")


def fresh_directory(out: str | None) -> Path:
    """``out``, or ``./eval_results/<timestamp>`` (suffixed until it does not exist)."""
    if out is not None:
        path = Path(out)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path, n = Path("eval_results") / stamp, 1
        while path.exists():
            n += 1
            path = Path("eval_results") / f"{stamp}-{n}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_eval(args, console=None) -> dict:
    """Runs the chosen tasks; writes ``<task>.json``/``.png`` and ``summary.json`` to the output
    directory and returns the summary."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
    from . import plots
    from .model_recall import model_recall
    from .passkey import describe_retrieval, passkey_grid
    from .position_loss import loss_by_position, loss_windows
    from .runtime import (data_spec, greedy_generate, heldout_stream, load_eval_tokenizer, load_model,
                          model_fingerprint, resolve_device, resolve_dtype, set_attention, sparse_config)

    console = console or Console(soft_wrap=True)
    meaning = {}  # what a figure says of this model, printed beside it
    out = fresh_directory(args.out)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    sparse = sparse_config(args.sparse_config)
    model = load_model(args.model, device, dtype)
    tokenizer = load_eval_tokenizer(args.tokenizer, args.model)
    stats = set_attention(model, args.attention, sparse, args.dense_kernel, args.static_density)
    deadline = None if args.time_budget is None else time.time() + args.time_budget
    loss_lengths = args.loss_lengths or [args.loss_length]
    need = max(max(args.lengths) * 2, (max(loss_lengths) + 1) * args.loss_windows, args.recall_length)
    ruler = "ruler" in args.tasks
    # the tasks' filler windows: from as much held-out text as 8 of the longest prompts, where there is as much
    stream = heldout_stream(data_spec(args.data), tokenizer, max(need, max(args.ruler_lengths) * 2 if ruler else 0),
                            8 * max(args.ruler_lengths) if ruler else None)
    layers = model.config.num_hidden_layers
    summary = {"model": str(Path(args.model).resolve()), "model_fingerprint": model_fingerprint(args.model),
               "attention": args.attention, "device": str(device),
               "dtype": str(dtype).replace("torch.", ""), "sparse": sparse.to_dict(),
               "args": {k: v for k, v in vars(args).items()}, "heldout_tokens": int(len(stream)), "files": {}}
    console.print(f"evaluating {args.model} ({args.attention} attention, {device}, {summary['dtype']}) -> {out}",
                  highlight=False)
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console, disable=args.no_progress) as progress:
        def bar(name, total):
            task = progress.add_task(name, total=total)
            return lambda: progress.advance(task)

        if "passkey" in args.tasks:
            advance = bar("passkey", len(args.lengths) * len(args.depths) * args.trials)
            new_step()  # each task: a step of its own for the once-per-step checks
            if stats is not None:
                stats.reset()
            result = passkey_grid(lambda ids, n: greedy_generate(model, ids, n), tokenizer, stream, args.lengths,
                                  args.depths, args.trials, args.digits, args.seed, advance)
            if stats is not None:
                result["sparse_density"] = stats.summary()["density"]
            result["mean_accuracy"] = float(np.mean(result["accuracy"]))
            _write(out, "passkey", result, summary)
            plots.passkey_heatmap(result, out / "passkey.png", f"passkey retrieval ({args.attention} attention)")
            summary["files"]["passkey_png"] = "passkey.png"
            summary["passkey_accuracy"] = result["mean_accuracy"]
            meaning["passkey_accuracy"] = describe_retrieval(result)
        if "loss" in args.tasks and args.loss_lengths:
            result = _loss_by_length(out, model, stream, args, stats, deadline, bar, summary["model_fingerprint"])
            _write(out, "loss_by_length", result, summary)
            summary["loss_by_length"] = {n: r["overall"] for n, r in result["results"].items()}
        elif "loss" in args.tasks:
            advance = bar("loss", args.loss_windows)
            new_step()  # each task: a step of its own for the once-per-step checks
            if stats is not None:
                stats.reset()
            windows = loss_windows(stream, args.loss_length, args.loss_windows)
            result = loss_by_position(model, windows, args.buckets, advance=advance)
            if stats is not None:
                result["sparse_density"] = stats.summary()["density"]
            _write(out, "loss_by_position", result, summary)
            plots.loss_curve(result, out / "loss_by_position.png", f"loss by position ({args.attention})")
            summary["files"]["loss_by_position_png"] = "loss_by_position.png"
            summary["loss"] = result["overall"]
        if "recall" in args.tasks:
            advance = bar("recall", layers)
            recall_dtype = torch.float32 if dtype != torch.float64 else torch.float64
            result = model_recall(model, stream[-args.recall_length:], sparse, recall_dtype, advance)
            _write(out, "recall", result, summary)
            plots.recall_heatmap(result, out / "recall.png")
            summary["files"]["recall_png"] = "recall.png"
            summary["recall"] = result["mean"]
        if ruler:
            result = _ruler(out, model, tokenizer, stream, args, stats, deadline, bar, summary["model_fingerprint"])
            _write(out, "ruler", result, summary)
            summary["ruler_complete"] = result["complete"]
            summary["ruler_accuracy"] = {task: {n: cell["accuracy"] for n, cell in by_length.items()}
                                         for task, by_length in result["tasks"].items()}
    write_json(out / "summary.json", summary)
    for key in ("passkey_accuracy", "loss", "recall", "loss_by_length", "ruler_accuracy"):
        if key in summary:
            console.print(f"{key}: {summary[key]}" + (f" ({meaning[key]})" if key in meaning else ""),
                          highlight=False)
    console.print(f"results: {out.resolve()}", highlight=False)
    return summary


def _write(out: Path, name: str, result: dict, summary: dict):
    write_json(out / f"{name}.json", result)
    summary["files"][name] = f"{name}.json"


def _merge_densities(earlier: dict | None, prompts: int, densities: list) -> dict:
    """Per-layer densities of ``prompts`` more prefills merged into ``earlier`` ones (weighted)."""
    if earlier:
        held = earlier["prompts"]
        densities = [(a * held + b * prompts) / (held + prompts) for a, b in zip(earlier["layer_density"], densities)]
        prompts += held
    return {"prompts": prompts, "layer_density": densities, "mean": float(np.mean(densities))}


def _loss_by_length(out: Path, model, stream, args, stats, deadline, bar, fingerprint: str) -> dict:
    """Loss by position at each of --loss_lengths, longest first (kept from an earlier call's
    loss_by_length.json; under sparse attention with each layer's index density)."""
    from .position_loss import loss_by_position, loss_windows
    from .runtime import layer_densities
    path = out / "loss_by_length.json"
    result = json.loads(path.read_text()) if path.is_file() else {"results": {}}
    result.update(lengths=sorted(set(args.loss_lengths)), windows=args.loss_windows, buckets=args.buckets)
    layers = model.config.num_hidden_layers
    for length in sorted(set(args.loss_lengths), reverse=True):
        if str(length) in result["results"]:
            continue
        if deadline is not None and time.time() >= deadline:
            break
        new_step()  # each length: a step of its own for the once-per-step checks
        if stats is not None:
            stats.reset()
        windows = loss_windows(stream, length, args.loss_windows)
        cell = loss_by_position(model, windows, args.buckets, advance=bar(f"loss at {length}", args.loss_windows))
        if stats is not None:
            cell["layer_density"] = layer_densities(stats.densities, layers)
            cell["sparse_density"] = float(np.mean(cell["layer_density"]))
        cell["model"] = fingerprint
        result["results"][str(length)] = cell
        write_json(path, result)
    result["complete"] = all(str(n) in result["results"] for n in args.loss_lengths)
    return result


def _ruler(out: Path, model, tokenizer, stream, args, stats, deadline, bar, fingerprint: str) -> dict:
    """The RULER-style tasks (:func:`.ruler.run_trials`), continuing the trials of an earlier call
    in ruler_trials.json (rewritten atomically every SAVE_EVERY_S and at the end); under sparse
    attention each layer's index density per length over the prompts' prefills."""
    from .ruler import run_trials, summarise, trial_key
    from .runtime import greedy_generate, layer_densities
    trials_path, summary_path = out / "ruler_trials.json", out / "ruler.json"
    rows = json.loads(trials_path.read_text())["rows"] if trials_path.is_file() else []
    earlier = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    densities = dict(earlier.get("layer_density", {}))
    layers = model.config.num_hidden_layers
    state = {"length": None, "prompts": 0, "saved": time.time()}

    def save():
        write_json(trials_path, {"rows": rows})
        state["saved"] = time.time()

    def record(row):
        row["model"] = fingerprint
        rows.append(row)
        if time.time() - state["saved"] >= SAVE_EVERY_S:
            save()

    def flush():
        if stats is not None and state["prompts"]:
            key = str(state["length"])
            densities[key] = _merge_densities(densities.get(key), state["prompts"],
                                              layer_densities(stats.densities, layers))
        state["prompts"] = 0
        if stats is not None:
            stats.reset()

    def on_prefill(length):
        if length != state["length"] or state["prompts"] >= 64:  # the recorded indices of 64 prompts at most
            flush()
            state["length"] = length
        new_step()  # each prompt: a step of its own for the once-per-step checks
        state["prompts"] += 1

    if stats is not None:
        stats.reset()
    cells = len(args.ruler_tasks) * len(args.ruler_lengths) * len(args.depths)
    ran = run_trials(lambda ids, n: greedy_generate(model, ids, n), tokenizer, stream, args.ruler_tasks,
                     args.ruler_lengths, args.depths, args.trials, args.target_width, args.max_trials, args.seed,
                     args.digits, {trial_key(r): r for r in rows}, record, deadline, on_prefill,
                     bar("RULER tasks", cells * args.trials))
    flush()
    save()
    return {"tasks": summarise(ran["rows"], args.target_width), "complete": ran["complete"],
            "lengths": sorted(args.ruler_lengths), "depths": args.depths, "trials_per_round": args.trials,
            "target_width": args.target_width, "max_trials": args.max_trials, "seed": args.seed,
            "layer_density": densities, "trials_file": trials_path.name}


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    try:
        run_eval(args)
    except (FileNotFoundError, ValueError) as error:
        print(f"ds_mtraining.eval: error: {error}", file=sys.stderr)
        sys.exit(2)
