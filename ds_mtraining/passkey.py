"""The passkey retrieval task's text and its assembly into token ids: the prompts that
:mod:`ds_mtraining.eval.passkey` scores, and the training samples that :mod:`ds_mtraining.data`
mixes in (``mtraining.data.passkey_fraction``).

A prompt of ``length`` tokens is ``INTRO + filler[:a] + NEEDLE + filler[a:n] + QUESTION`` with
``n = length - len(INTRO) - len(NEEDLE) - len(QUESTION)`` filler tokens and ``a = round(depth n)``
(depth 0: the needle right after the intro, 1: right before the question). The expected answer is
the key's tokens after ``QUESTION`` (``" 71432"``). Everything works on token ids, so any
tokenizer with ``encode`` / ``decode`` (:mod:`ds_mtraining.data`'s byte tokenizer or a local HF
one) fits. :func:`passkey_training_sample` builds the same task, answer included, as a training
window.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it at the end.\n\n")
NEEDLE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"
ANSWER = " {key}"
DEFAULT_DIGITS = 5


def random_key(rng: np.random.Generator, digits: int = DEFAULT_DIGITS) -> str:
    """A ``digits``-digit decimal key without a leading zero."""
    if digits < 1:
        raise ValueError(f"digits={digits} must be >= 1")
    first = str(int(rng.integers(1, 10)))
    return first + "".join(str(int(d)) for d in rng.integers(0, 10, digits - 1))


@dataclass
class PasskeyPrompt:
    """A prompt (int64 token ids), its key, where the needle starts and how long it is (tokens),
    and the expected answer's tokens."""

    input_ids: np.ndarray
    key: str
    depth: float
    needle_start: int
    needle_length: int
    answer_ids: np.ndarray


def _encode(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer.encode(text), dtype=np.int64)


def _assemble(tokenizer, filler: np.ndarray, length: int, depth: float, key: str, answer: bool,
              asked_before: int = 0, rng: np.random.Generator | None = None):
    """The prompt; ``asked_before`` more question + answer pairs go into the filler after the
    needle at uniform random places (``rng``), before the final question."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} must lie in [0, 1] (share of the filler before the needle)")
    intro, needle, question = (_encode(tokenizer, t) for t in (INTRO, NEEDLE.format(key=key), QUESTION))
    answer_ids = _encode(tokenizer, ANSWER.format(key=key))
    fixed = (len(intro) + len(needle) + len(question) + (len(answer_ids) if answer else 0)
             + asked_before * (len(question) + len(answer_ids)))
    n = length - fixed
    if n < 0:
        raise ValueError(f"length {length} is shorter than the passkey prompt's fixed text ({fixed} tokens)")
    if len(filler) < n:
        raise ValueError(f"{len(filler)} filler tokens given, {n} needed for length {length}")
    at = int(round(depth * n))
    after = [filler[at:n]]
    if asked_before:
        cuts = np.sort(rng.integers(0, n - at + 1, asked_before))
        pieces = np.split(filler[at:n], cuts)
        after = [pieces[0]]
        for piece in pieces[1:]:
            after += [question, answer_ids, piece]
    parts = [intro, filler[:at], needle, *after, question] + ([answer_ids] if answer else [])
    ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    return PasskeyPrompt(ids, key, depth, len(intro) + at, len(needle), answer_ids)


def passkey_prompt(tokenizer, filler: np.ndarray, length: int, depth: float, key: str) -> PasskeyPrompt:
    """A ``length``-token prompt (see the module docstring) using ``filler[:n]`` as its text."""
    return _assemble(tokenizer, filler, length, depth, key, answer=False)


def passkey_training_sample(tokens: np.ndarray, tokenizer, rng: np.random.Generator,
                            digits: int = DEFAULT_DIGITS, questions: int = 1) -> np.ndarray:
    """The training window ``tokens`` (L + 1 ids of real text) turned into a passkey sample of
    the same length: a random key at a uniform random depth, filler from the window itself, the
    question and the answer at the end (so the last tokens' labels are the key). ``questions``
    > 1 also asks ``questions - 1`` times at uniform random places after the needle, each
    question followed by its answer: more retrieval examples per sample (the first of them
    retrieves from the needle, later ones may copy the nearest answer)."""
    if questions < 1:
        raise ValueError(f"questions={questions} must be >= 1")
    prompt = _assemble(tokenizer, np.asarray(tokens), len(tokens), float(rng.random()),
                       random_key(rng, digits), answer=True, asked_before=questions - 1, rng=rng)
    return prompt.input_ids.astype(np.asarray(tokens).dtype)


def passkey_fixed_tokens(tokenizer, digits: int = DEFAULT_DIGITS, questions: int = 1) -> int:
    """Tokens of a passkey training sample that are not filler (intro, needle, questions, answers)."""
    key = "9" * digits
    parts = [INTRO, NEEDLE.format(key=key)] + [QUESTION, ANSWER.format(key=key)] * questions
    return sum(len(_encode(tokenizer, text)) for text in parts)
