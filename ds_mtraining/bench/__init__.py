"""Benchmarks: kernel speed (GPU and CPU), ring balance, ring communication model."""
from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from ..index import SparseIndex

RESULTS_ROOT = Path("bench_results")  # fresh default outputs; benchmarks/results/ only with --out


def fresh_output_dir(name: str) -> Path:
    """A new ``./bench_results/<name>-<local time>`` directory (``-2``, ``-3``... if taken): a
    benchmark run never writes over an earlier one, nor over the committed benchmarks/results/
    (which only an explicit ``--out`` writes)."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = RESULTS_ROOT / f"{name}-{stamp}", 1
    while path.exists():
        n += 1
        path = RESULTS_ROOT / f"{name}-{stamp}-{n}"
    path.mkdir(parents=True)
    return path


def params_of(args: argparse.Namespace) -> dict:
    """A benchmark's arguments as its result file's ``params`` (:func:`ds_mtraining.record.result_record`):
    paths as strings, so that the record is JSON."""
    def plain(value):
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value
    return {name: plain(value) for name, value in vars(args).items()}


def command_of(module: str, argv: list[str] | None) -> str | None:
    """The command line of a benchmark's ``main(argv)``: ``python -m <module> <argv>`` where a caller
    passed argv (a test, another benchmark), None where it came from this process's own command
    line (the record's default then names it)."""
    return None if argv is None else shlex.join(["python", "-m", module, *map(str, argv)])


def index_for_density(build: Callable[[int], SparseIndex], most: int, target: float) -> SparseIndex:
    """The index ``build(n)``, n in [0, most], whose density is closest to ``target``, found by
    bisection (density grows with n, e.g. the number of slash diagonals)."""
    low, high, best = 0, most, None
    while low <= high:
        middle = (low + high) // 2
        index = build(middle)
        density = index.density()
        if best is None or abs(density - target) < abs(best.density() - target):
            best = index
        if density < target:
            low = middle + 1
        else:
            high = middle - 1
    return best


def time_ms(fn, warmup: int = 3, repeats: int = 10) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs, timed with CUDA
    events around each run (the GPU benchmarks). The runs are queued back to back, as a training
    loop queues its steps: the CPU queues a run while the GPU works on the one before, so a run's
    time is its GPU time, without the wait for the first launch that a synchronize before each
    run would add (about 0.6 ms for FlexAttention's forward+backward at 128K)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def kernel_split_ms(fn, label: Callable[[str], str], repeats: int = 3) -> dict:
    """CUDA time per kernel of one ``fn()`` call (mean over ``repeats`` profiled calls after one
    warm-up), in milliseconds, keyed by ``label(kernel name)`` (kernels with one label add up):
    where a benchmark's time goes, beside its CUDA-event total."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    split = {}
    for event in profiler.key_averages():
        microseconds = event.self_device_time_total
        if microseconds > 0 and not event.is_user_annotation:  # ranges spanning kernels: not kernels
            key = label(event.key)
            split[key] = split.get(key, 0.0) + microseconds / 1e3 / repeats
    return dict(sorted(split.items(), key=lambda item: -item[1]))


def wall_time_ms(fn, repeats: int, warmup: int = 1) -> float:
    """Median wall-clock milliseconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs (the
    CPU benchmarks)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
