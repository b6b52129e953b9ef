"""RULER-style retrieval and tracking tasks: their text and its assembly into token ids, for the
prompts that :mod:`ds_mtraining.eval.ruler` scores and the training samples that
:mod:`ds_mtraining.data` mixes in (``mtraining.data.task_fractions``).

Tasks (:data:`TASKS`), each hidden in filler text (real text: a held-out window when evaluating,
the sample's own window when training) and asked for at the end:

* ``passkey``: one key (:mod:`ds_mtraining.passkey`'s prompt, unchanged);
* ``multikey``: :data:`MULTIKEY_KEYS` needles "One of the special magic numbers for <key> is:
  <value>.", each with its own key and value; the first key is asked for. Its needle is placed at
  the requested depth, the others (distractors) at uniform random depths;
* ``multivalue``: :data:`MULTIVALUE_VALUES` needles of the same key with different values; all
  values are asked for, the answer lists them in their order in the text. The first needle is at
  the requested depth, the others at uniform random depths between it and the end;
* ``vartrack``: a chain of assignments ``VAR A = 12345``, ``VAR B = VAR A``, ... (:data:`VARTRACK_HOPS`
  after the first); asked: which variables hold the value (all names of the chain). The first
  assignment is at the requested depth, the others in chain order at uniform random depths between
  it and the end.

The depth is the share of the filler before the task's first piece (0: right after the intro,
1: right before the question): for multivalue and vartrack it is the farthest piece's, the one
that the longest-range attention must find. A prompt of ``length`` tokens is the intro, the
filler with the pieces inserted, and the question; ``n = length - fixed`` filler tokens, a piece at
depth d goes after ``round(d n)`` of them (pieces at the same place keep their order). The
expected answer is the text after the question (e.g. ``" 71432"``). Everything works on token ids,
so any tokenizer with ``encode``/``decode`` fits (the byte tokenizer of the quality studies: ASCII
text, one token per character).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .passkey import DEFAULT_DIGITS, passkey_prompt, passkey_training_sample, random_key

TASKS = ("passkey", "multikey", "multivalue", "vartrack")
MULTIKEY_KEYS = 4  # needles of a multikey prompt (one asked, the others distractors)
MULTIVALUE_VALUES = 4  # values of the one key of a multivalue prompt
VARTRACK_HOPS = 4  # assignments after the first: a chain of 5 variables
KEY_LETTERS = 6  # a multikey/multivalue key: lowercase letters
NAME_LETTERS = 5  # a variable's name: uppercase letters

MAGIC_INTRO = ("Some special magic numbers are hidden inside the following text. Make sure to memorize them. "
               "I will quiz you about the numbers afterwards.\n\n")
MAGIC_NEEDLE = "\n\nOne of the special magic numbers for {key} is: {value}.\n\n"
MULTIKEY_QUESTION = "\n\nWhat is the special magic number for {key}? The special magic number for {key} is"
MULTIVALUE_QUESTION = ("\n\nWhat are all the special magic numbers for {key}? The special magic numbers for "
                       "{key} are")
VARTRACK_INTRO = "Memorize and track the chain of variable assignments hidden in the following text.\n\n"
VARTRACK_FIRST = "\n\nVAR {name} = {value}\n\n"
VARTRACK_NEXT = "\n\nVAR {name} = VAR {previous}\n\n"
VARTRACK_QUESTION = ("\n\nFind all variables that are assigned the value {value}. The variables assigned the "
                     "value {value} are")


@dataclass
class TaskPrompt:
    """A prompt (int64 token ids) of one task; ``answer`` the items a right answer holds (the key,
    the values, the names), ``answer_ids`` the expected answer's tokens after the prompt, and
    ``pieces`` the (start, length) in tokens of each inserted needle, the first one (the asked
    needle, the first value, the chain's first assignment) first."""

    task: str
    input_ids: np.ndarray
    depth: float
    answer: list
    answer_ids: np.ndarray
    pieces: list = field(default_factory=list)


def _encode(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer.encode(text), dtype=np.int64)


def _distinct(draw, count: int) -> list[str]:
    """``count`` distinct values of ``draw()`` (in draw order)."""
    values: list[str] = []
    while len(values) < count:
        value = draw()
        if value not in values:
            values.append(value)
    return values


def random_word(rng: np.random.Generator, letters: int, upper: bool = False) -> str:
    base = ord("A" if upper else "a")
    return "".join(chr(base + int(c)) for c in rng.integers(0, 26, letters))


class TaskText(NamedTuple):
    """One task's text: ``pieces`` [(depth, text)] go into the filler, the first one at the asked
    depth; ``question`` and ``answer`` end the prompt, ``items`` are what a right answer holds;
    ``asks`` [(depth, question, answer)] are every question the text can answer, each from the
    depth on where all it needs has come (a training sample asks some of them early too)."""

    intro: str
    pieces: list
    question: str
    answer: str
    items: list
    asks: list


def task_text(task: str, depth: float, rng: np.random.Generator, digits: int = DEFAULT_DIGITS) -> TaskText:
    """The text of one ``multikey``, ``multivalue`` or ``vartrack`` task, keys, values, names and
    the other pieces' depths drawn from ``rng``."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} must lie in [0, 1] (share of the filler before the first needle)")
    if task == "multikey":
        keys = _distinct(lambda: random_word(rng, KEY_LETTERS), MULTIKEY_KEYS)
        values = _distinct(lambda: random_key(rng, digits), MULTIKEY_KEYS)
        depths = [depth] + [float(d) for d in rng.random(MULTIKEY_KEYS - 1)]
        pieces = [(d, MAGIC_NEEDLE.format(key=k, value=v)) for d, k, v in zip(depths, keys, values)]
        asks = [(d, MULTIKEY_QUESTION.format(key=k), f" {v}") for d, k, v in zip(depths, keys, values)]
        return TaskText(MAGIC_INTRO, pieces, *asks[0][1:], [values[0]], asks)
    if task == "multivalue":
        key = random_word(rng, KEY_LETTERS)
        values = _distinct(lambda: random_key(rng, digits), MULTIVALUE_VALUES)
        depths = [depth] + sorted(float(depth + (1 - depth) * d) for d in rng.random(MULTIVALUE_VALUES - 1))
        pieces = [(d, MAGIC_NEEDLE.format(key=key, value=v)) for d, v in zip(depths, values)]
        ask = (depths[-1], MULTIVALUE_QUESTION.format(key=key), " " + ", ".join(values))
        return TaskText(MAGIC_INTRO, pieces, *ask[1:], values, [ask])
    if task == "vartrack":
        names = _distinct(lambda: random_word(rng, NAME_LETTERS, upper=True), VARTRACK_HOPS + 1)
        value = random_key(rng, digits)
        depths = [depth] + sorted(float(depth + (1 - depth) * d) for d in rng.random(VARTRACK_HOPS))
        texts = [VARTRACK_FIRST.format(name=names[0], value=value)] + [
            VARTRACK_NEXT.format(name=name, previous=previous) for previous, name in zip(names, names[1:])]
        ask = (depths[-1], VARTRACK_QUESTION.format(value=value), " " + " ".join(names))
        return TaskText(VARTRACK_INTRO, list(zip(depths, texts)), *ask[1:], names, [ask])
    raise ValueError(f"task {task!r} is unknown; the tasks are {list(TASKS)}")


def _assemble(task: str, tokenizer, filler: np.ndarray, length: int, depth: float, text: TaskText,
              answer: bool) -> TaskPrompt:
    intro_text, pieces, question_text, answer_text, items, _ = text
    intro, question, answer_ids = (_encode(tokenizer, t) for t in (intro_text, question_text, answer_text))
    piece_ids = [_encode(tokenizer, t) for _, t in pieces]
    fixed = len(intro) + sum(len(p) for p in piece_ids) + len(question) + (len(answer_ids) if answer else 0)
    n = length - fixed
    if n < 0:
        raise ValueError(f"length {length} is shorter than the {task} prompt's fixed text ({fixed} tokens)")
    if len(filler) < n:
        raise ValueError(f"{len(filler)} filler tokens given, {n} needed for length {length}")
    places = [int(round(d * n)) for d, _ in pieces]
    parts, spans, done, position = [intro], [None] * len(pieces), 0, len(intro)
    for i in sorted(range(len(pieces)), key=lambda i: (places[i], i)):
        parts.append(filler[done:places[i]])
        position += places[i] - done
        done = places[i]
        spans[i] = (position, len(piece_ids[i]))
        parts.append(piece_ids[i])
        position += len(piece_ids[i])
    parts += [filler[done:n], question] + ([answer_ids] if answer else [])
    ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    return TaskPrompt(task, ids, depth, items, answer_ids, spans)


def task_prompt(task: str, tokenizer, filler: np.ndarray, length: int, depth: float, rng: np.random.Generator,
                digits: int = DEFAULT_DIGITS) -> TaskPrompt:
    """A ``length``-token prompt of ``task`` (see the module docstring) with ``filler[:n]`` as its
    text, its keys/values/names drawn from ``rng``."""
    if task == "passkey":
        prompt = passkey_prompt(tokenizer, filler, length, depth, random_key(rng, digits))
        return TaskPrompt(task, prompt.input_ids, depth, [prompt.key], prompt.answer_ids,
                          [(prompt.needle_start, prompt.needle_length)])
    return _assemble(task, tokenizer, filler, length, depth, task_text(task, depth, rng, digits), answer=False)


def task_training_sample(task: str, tokens: np.ndarray, tokenizer, rng: np.random.Generator,
                         digits: int = DEFAULT_DIGITS, questions: int = 1) -> np.ndarray:
    """The training window ``tokens`` (L + 1 ids of real text) turned into a sample of ``task`` of
    the same length: the task at a uniform random depth, filler from the window itself, the
    question and the answer at the end (so the last tokens' labels are the answer). ``questions``
    > 1 also asks ``questions - 1`` times in the filler, each question followed by its answer: one
    of the text's questions drawn at random (multikey: any of its keys), at a uniform random place
    after all that it needs. A model learns retrieval from many answers a sample, not one."""
    if questions < 1:
        raise ValueError(f"questions={questions} must be >= 1")
    tokens = np.asarray(tokens)
    if task == "passkey":
        return passkey_training_sample(tokens, tokenizer, rng, digits, questions)
    depth = float(rng.random())
    text = task_text(task, depth, rng, digits)
    if questions > 1:  # after the task's pieces in the list: at the same place, the needle comes first
        asked = rng.integers(0, len(text.asks), questions - 1)
        places = rng.random(questions - 1)
        text = text._replace(pieces=text.pieces + [
            (at + (1 - at) * float(u), question + answer)
            for (at, question, answer), u in zip((text.asks[a] for a in asked), places)])
    prompt = _assemble(task, tokenizer, tokens, len(tokens), depth, text, answer=True)
    return prompt.input_ids.astype(tokens.dtype)


def task_fixed_tokens(task: str, tokenizer, digits: int = DEFAULT_DIGITS, questions: int = 1) -> int:
    """Tokens of a ``task`` training sample that are not filler (intro, needles, questions, answers)."""
    if task == "passkey":
        from .passkey import passkey_fixed_tokens
        return passkey_fixed_tokens(tokenizer, digits, questions)
    text = task_text(task, 0.0, np.random.default_rng(0), digits)
    ask = max(len(_encode(tokenizer, question + answer)) for _, question, answer in text.asks)
    return (sum(len(_encode(tokenizer, t)) for t in [text.intro, *(p for _, p in text.pieces), text.question,
                                                      text.answer]) + (questions - 1) * ask)
