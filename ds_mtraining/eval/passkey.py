"""Passkey retrieval: a random number hidden at a chosen depth of real filler text, asked for at
the end; scored by exact match of the greedily generated answer.

The prompt (:mod:`ds_mtraining.passkey`: its text and assembly, shared with the training samples
that :mod:`ds_mtraining.data` mixes in) takes its filler from a contiguous window of real text (a
held-out token stream, e.g. the standard library's sources, at a random offset): no repeated
sentences.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..passkey import DEFAULT_DIGITS, passkey_prompt, random_key


def exact_match(generated: str, key: str) -> bool:
    """True iff the generated text's first number (after optional leading whitespace) is exactly
    ``key``: ``" 71432."`` matches 71432; ``"714320"``, ``"7143"`` and ``"the key 71432"`` do not."""
    found = re.match(r"\s*(\d+)", generated)
    return found is not None and found.group(1) == key


@dataclass
class PasskeyTrial:
    length: int
    depth: float
    trial: int
    key: str
    generated: str
    correct: bool


def filler_window(stream: np.ndarray, length: int, rng: np.random.Generator) -> np.ndarray:
    """``length`` consecutive tokens of ``stream`` at a random offset."""
    if len(stream) < length:
        raise ValueError(f"the held-out text holds {len(stream)} tokens, a prompt needs {length}; "
                         f"give more text or shorter lengths")
    start = int(rng.integers(0, len(stream) - length + 1))
    return stream[start:start + length]


def passkey_grid(generate, tokenizer, stream: np.ndarray, lengths, depths, trials: int = 1,
                 digits: int = DEFAULT_DIGITS, seed: int = 0, advance=None) -> dict:
    """Runs the depth x length grid. ``generate(input_ids np.int64 [n], max_new_tokens) -> token
    ids`` is the model's greedy decoder; ``advance()`` is called after each prompt (progress).

    Returns ``{"lengths", "depths", "accuracy": [len(depths)][len(lengths)], "trials": [...]}``."""
    records = []
    accuracy = np.zeros((len(depths), len(lengths)))
    for j, length in enumerate(lengths):
        for i, depth in enumerate(depths):
            for t in range(trials):
                rng = np.random.default_rng([seed, int(length), int(round(depth * 1e6)), t])
                key = random_key(rng, digits)
                prompt = passkey_prompt(tokenizer, filler_window(stream, length, rng), length, depth, key)
                new = generate(prompt.input_ids, len(prompt.answer_ids) + 2)
                text = tokenizer.decode(new)
                correct = exact_match(text, key)
                accuracy[i, j] += correct / trials
                records.append(PasskeyTrial(int(length), float(depth), t, key, text, bool(correct)))
                if advance is not None:
                    advance()
    return {"lengths": [int(x) for x in lengths], "depths": [float(d) for d in depths],
            "accuracy": accuracy.tolist(), "trials": [vars(r) for r in records]}


def describe_retrieval(result: dict) -> str:
    """What :func:`passkey_grid`'s figure says of the model just evaluated, in words: the figure
    alone (0.0) reads like a broken export, where a model trained for a few steps cannot retrieve
    yet."""
    trials = result["trials"]
    correct = sum(trial["correct"] for trial in trials)
    numbers = sum(re.match(r"\s*\d", trial["generated"]) is not None for trial in trials)
    text = f"{correct} of {len(trials)} hidden keys repeated exactly by the greedy answer"
    if correct == len(trials):
        return text
    if numbers == 0:
        text += (f"; no answer starts with a number (the first: {trials[0]['generated']!r}): the model has not "
                 f"learned to answer yet, as after a short run")
    else:
        text += f"; {numbers - correct} answered another number"
    return text + ("; a model trained with passkey samples (passkey_fraction in mtraining.data) at these lengths "
                   "retrieves most keys: docs/RESULTS.md#quality")
