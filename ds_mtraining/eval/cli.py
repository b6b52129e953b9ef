"""``python -m ds_mtraining.eval MODEL_DIR``: passkey retrieval, loss by position and attention
recall of an exported HF causal LM (see :mod:`ds_mtraining.eval`)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..step import new_step

TASKS = ("passkey", "loss", "recall")


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


def _tasks(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    unknown = sorted(set(values) - set(TASKS))
    if unknown or not values:
        raise argparse.ArgumentTypeError(f"unknown task(s) {unknown or text!r}; choose from {list(TASKS)}")
    return values


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
    parser.add_argument("--tasks", type=_tasks, default=",".join(TASKS), help="comma-separated subset of " + ",".join(TASKS))
    parser.add_argument("--out", default=None, help="output directory (default: ./eval_results/<timestamp>)")
    parser.add_argument("--attention", choices=("dense", "sparse"), default="dense",
                        help="dense SDPA (as the paper evaluates) or MTraining's sparse prefill (one process)")
    parser.add_argument("--sparse_config", default=None,
                        help="estimator settings: a DeepSpeed JSON (its mtraining.sparse) or inline JSON of "
                             "SparseConfig fields; default SparseConfig()")
    parser.add_argument("--lengths", type=_ints, default="1024,2048,4096,8192", help="passkey prompt lengths (tokens)")
    parser.add_argument("--depths", type=_depths, default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1]")
    parser.add_argument("--trials", type=int, default=2, help="random keys per grid cell")
    parser.add_argument("--digits", type=int, default=5, help="digits of the passkey")
    parser.add_argument("--loss_length", type=int, default=None,
                        help="tokens per loss window, the trained length (default: the largest --lengths)")
    parser.add_argument("--loss_windows", type=int, default=4, help="held-out windows for the loss")
    parser.add_argument("--buckets", type=int, default=16, help="position buckets of the loss")
    parser.add_argument("--recall_length", type=int, default=None,
                        help="tokens of the recall sequence (default: the largest --lengths)")
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
    if args.attention == "sparse":
        from .runtime import sparse_config
        block = sparse_config(args.sparse_config).block_size
        lengths = {"--lengths": args.lengths, "--loss_length": [args.loss_length]}
        for flag, values in lengths.items():
            bad = [n for n in values if n % block]
            if bad:
                parser.error(f"{flag} {bad}: sparse attention needs multiples of the block size {block}")


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
                          resolve_device, resolve_dtype, set_attention, sparse_config)

    console = console or Console(soft_wrap=True)
    meaning = {}  # what a figure says of this model, printed beside it
    out = fresh_directory(args.out)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    sparse = sparse_config(args.sparse_config)
    model = load_model(args.model, device, dtype)
    tokenizer = load_eval_tokenizer(args.tokenizer, args.model)
    stats = set_attention(model, args.attention, sparse)
    need = max(max(args.lengths) * 2, (args.loss_length + 1) * args.loss_windows, args.recall_length)
    stream = heldout_stream(data_spec(args.data), tokenizer, need)
    layers = model.config.num_hidden_layers
    summary = {"model": str(Path(args.model).resolve()), "attention": args.attention, "device": str(device),
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
        if "loss" in args.tasks:
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
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    for key in ("passkey_accuracy", "loss", "recall"):
        if key in summary:
            console.print(f"{key}: {summary[key]}" + (f" ({meaning[key]})" if key in meaning else ""),
                          highlight=False)
    console.print(f"results: {out.resolve()}", highlight=False)
    return summary


def _write(out: Path, name: str, result: dict, summary: dict):
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    summary["files"][name] = f"{name}.json"


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    try:
        run_eval(args)
    except (FileNotFoundError, ValueError) as error:
        print(f"ds_mtraining.eval: error: {error}", file=sys.stderr)
        sys.exit(2)
