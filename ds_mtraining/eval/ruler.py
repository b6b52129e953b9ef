"""RULER-style tasks (:mod:`ds_mtraining.ruler`: single passkey, multi-key needle, multi-value
needle, variable tracking) over a task x length x depth grid: scoring, 95% intervals, and how
many trials an interval of a given width needs.

Scoring follows the passkey evaluation (:mod:`.passkey`): the model's greedy answer (one prefill
of the whole prompt, then greedy decoding of the answer's length + 2 tokens) must hold exactly the
expected items: the key for passkey and multikey (its first number, :func:`exact_match`), all the
values for multivalue (its first numbers, in any order), all the chain's names for vartrack (its
first capitalised words, in any order). Greedy decoding, not a teacher-forced argmax: it scores
what the model would answer, and under sparse evaluation the whole prompt, question included, is
one sparse prefill, as it would be served. A trial is right or wrong, so a (task, length)'s
accuracy is a binomial share with a Wilson interval (:func:`wilson_interval`).

Trials are seeded by (seed, task, length, depth, trial number): every model sees the same prompts
(same filler window, same keys), and trial t of a cell is the same whether it runs in the first
call or a resumed one. :func:`run_trials` runs rounds of ``trials`` per depth, longest length first,
until each (task, length)'s interval over its depths is narrower than ``target_width`` (or it
holds ``max_trials``), handing each trial to ``record`` as it ends and skipping those in ``done``:
a run cut short by its deadline continues where it stopped.
"""
from __future__ import annotations

import math
import re
import time

import numpy as np

from ..passkey import DEFAULT_DIGITS
from ..ruler import TASKS, task_prompt
from .passkey import exact_match, filler_window

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: two-sided 95%
TASK_SEEDS = {task: number for number, task in enumerate(TASKS, start=1)}


# ----------------------------------------------------------------------------- scoring
def score(task: str, generated: str, answer: list) -> bool:
    """Whether the greedy answer ``generated`` (text) is right for ``task`` with expected items
    ``answer`` (see the module docstring)."""
    if task in ("passkey", "multikey"):
        return exact_match(generated, answer[0])
    if task == "multivalue":
        return sorted(re.findall(r"\d+", generated)[:len(answer)]) == sorted(answer)
    if task == "vartrack":
        return sorted(re.findall(r"[A-Z]+", generated)[:len(answer)]) == sorted(answer)
    raise ValueError(f"task {task!r} is unknown; the tasks are {list(TASKS)}")


# ----------------------------------------------------------------------------- intervals
def wilson_interval(successes: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial share (95% by default); (0, 1) with no trials. It
    holds the share itself exactly (rounding put 0 of 50's lower bound at 7e-18, above the share)."""
    if trials <= 0:
        return 0.0, 1.0
    p, n = successes / trials, trials
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half))


def wilson_width(accuracy: float, trials: int, z: float = Z95) -> float:
    """The width of the Wilson interval at share ``accuracy`` over ``trials`` trials."""
    if trials <= 0:
        return 1.0
    n = trials
    return 2 * z * math.sqrt(accuracy * (1 - accuracy) / n + z * z / (4 * n * n)) / (1 + z * z / n)


def trials_for_width(accuracy: float, width: float = 0.04, z: float = Z95) -> int:
    """The fewest trials whose Wilson interval at share ``accuracy`` is narrower than ``width``
    (4 points by default: 2398 at 50%, 868 at 90%, 303 at 97%, 93 at 0% or 100%)."""
    if not 0.0 <= accuracy <= 1.0 or width <= 0:
        raise ValueError(f"accuracy {accuracy} must lie in [0, 1] and width {width} be positive")
    high = 1
    while wilson_width(accuracy, high, z) >= width:
        high *= 2
    low = high // 2  # wilson_width falls as the trials grow: the first n below width lies in (low, high]
    while high - low > 1:
        middle = (low + high) // 2
        if wilson_width(accuracy, middle, z) < width:
            high = middle
        else:
            low = middle
    return high


# ----------------------------------------------------------------------------- the grid
def trial_key(row: dict) -> tuple:
    return row["task"], int(row["length"]), float(row["depth"]), int(row["trial"])


def trial_rng(seed: int, task: str, length: int, depth: float, trial: int) -> np.random.Generator:
    return np.random.default_rng([seed, TASK_SEEDS[task], int(length), int(round(depth * 1e6)), trial])


def cell_summary(rows: list, z: float = Z95) -> dict:
    """Accuracy, count and Wilson interval of some trials' rows."""
    correct, trials = sum(bool(r["correct"]) for r in rows), len(rows)
    low, high = wilson_interval(correct, trials, z)
    return {"trials": trials, "correct": correct, "accuracy": correct / trials if trials else None,
            "interval": [low, high], "width": high - low}


def summarise(rows: list, target_width: float | None = 0.04) -> dict:
    """``{task: {length: {trials, correct, accuracy, interval, width, narrower_than_target,
    by_depth: {depth: {...}}}}}`` of the trials' rows (the ``record`` rows of :func:`run_trials`)."""
    result: dict = {}
    for row in rows:
        result.setdefault(row["task"], {}).setdefault(str(int(row["length"])), []).append(row)
    for task, by_length in result.items():
        for length, cell in by_length.items():
            depths: dict = {}
            for row in cell:
                depths.setdefault(float(row["depth"]), []).append(row)
            summary = cell_summary(cell)
            if target_width is not None:
                summary["narrower_than_target"] = summary["width"] < target_width
            summary["by_depth"] = {f"{d:g}": cell_summary(depths[d]) for d in sorted(depths)}
            by_length[length] = summary
    return result


def run_trials(generate, tokenizer, stream: np.ndarray, tasks, lengths, depths, trials: int = 8,
               target_width: float | None = 0.04, max_trials: int | None = None, seed: int = 0,
               digits: int = DEFAULT_DIGITS, done: dict | None = None, record=None,
               deadline: float | None = None, on_prefill=None, advance=None) -> dict:
    """Runs the task x length x depth grid (see the module docstring). ``generate(input_ids
    np.int64 [n], max_new_tokens) -> token ids`` is the model's greedy decoder; ``done``: {trial
    key: row} of trials already run (skipped, counted); ``record(row)`` gets each new trial's row
    ({task, length, depth, trial, answer, generated, correct, seconds}); ``deadline``
    (time.time()) stops before a trial that would start after it; ``on_prefill(length)`` is called
    before each prompt (per-length statistics); ``advance()`` after it.

    Each (task, length) runs rounds of ``trials`` per depth while its interval over all depths
    is at least ``target_width`` wide (None: one round) and it holds fewer than ``max_trials``
    (default: one round). Returns ``{"rows": [...], "complete": bool}`` (every cell finished)."""
    rows = dict(done or {})
    max_trials = max_trials or trials * len(depths)
    per_round = trials * len(depths)
    complete = True
    for length in sorted({int(n) for n in lengths}, reverse=True):  # the longest first: the goals' length
        open_tasks, round_number = list(tasks), 0
        while open_tasks:
            for task in list(open_tasks):
                for t in range(round_number * trials, (round_number + 1) * trials):
                    for depth in depths:
                        key = (task, length, float(depth), t)
                        if key in rows:
                            continue
                        if deadline is not None and time.time() >= deadline:
                            return {"rows": list(rows.values()), "complete": False}
                        rng = trial_rng(seed, task, length, float(depth), t)
                        prompt = task_prompt(task, tokenizer, filler_window(stream, length, rng), length,
                                             float(depth), rng, digits)
                        if on_prefill is not None:
                            on_prefill(length)
                        began = time.time()
                        text = tokenizer.decode(generate(prompt.input_ids, len(prompt.answer_ids) + 2))
                        row = {"task": task, "length": length, "depth": float(depth), "trial": t,
                               "answer": prompt.answer, "generated": text, "correct": score(task, text, prompt.answer),
                               "seconds": time.time() - began}
                        rows[key] = row
                        if record is not None:
                            record(row)
                        if advance is not None:
                            advance()
                cell = [r for k, r in rows.items() if k[0] == task and k[1] == length]
                held = (round_number + 1) * per_round
                narrow = target_width is None or cell_summary(cell)["width"] < target_width
                if narrow or held >= max_trials:
                    open_tasks.remove(task)
            round_number += 1
    return {"rows": list(rows.values()), "complete": complete}
