"""Does a byte-level model copy what it has seen? Teacher-forced losses behind the 128K quality
study's diagnosis (docs/RESULTS.md, under the 128K row): a model that answers every passkey with
the same digits either cannot find the needle or cannot copy digits at all; this tells which.

* ``passkey``: a passkey training sample (:func:`ds_mtraining.passkey.passkey_training_sample`,
  the held-out text's last documents as filler, as ``ds_mtraining.eval`` reads them) asking ``--questions`` times; the mean loss of the answer's digits
  at each question. Later questions can copy the answer just before them, the first only the
  needle. ln 10 = 2.30 nats is a uniform guess among digits;
* ``repeat_digits`` / ``repeat_letters``: 200 random digits (letters) and the same string again;
  the loss of the first copy and of the second (an induction head makes the second near zero);
* ``identifier``: a function name used a second time in a few lines of code.

Runs on a CPU in a minute at 4K (float32, torch SDPA: the reference attention):

    python3 benchmarks/probes/copy_probe.py MODEL_DIR --data data/quality [--length 4096]
        [--questions 8] [--samples 3] [--out copy_probe.json]
"""
import argparse
import math

import numpy as np
import torch

from ds_mtraining.data import load_tokenizer
from ds_mtraining.eval.runtime import data_spec, heldout_stream, load_model
from ds_mtraining.passkey import QUESTION, passkey_training_sample
from ds_mtraining.record import write_result

CODE = ("def compute_total(items):\n    total = 0\n    for item in items:\n        total += item.price\n"
        "    return total\n\nresult = compute_total(items)\n")


def token_losses(model, ids) -> np.ndarray:
    """Loss of each token given the ones before it (index i: token i + 1)."""
    x = torch.as_tensor(np.asarray(ids, dtype=np.int64))[None]
    with torch.no_grad():
        logits = model(x).logits[0, :-1].float()
    return -torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), x[0, 1:]].numpy()


def span_loss(losses: np.ndarray, start: int, end: int) -> float:
    """Mean loss of tokens start .. end - 1."""
    return float(losses[start - 1:end - 1].mean())


def passkey_rows(model, tokenizer, ids: np.ndarray, length: int, questions: int, samples: int, seed: int) -> list:
    question = list(tokenizer.encode(QUESTION))
    rng, rows = np.random.default_rng(seed), []
    for sample in range(samples):
        start = int(rng.integers(0, len(ids) - length - 1))
        tokens = passkey_training_sample(ids[start:start + length + 1], tokenizer, rng, questions=questions).tolist()
        losses = token_losses(model, tokens)
        asked = [i + len(question) for i in range(len(tokens) - len(question))
                 if tokens[i:i + len(question)] == question]
        for number, at in enumerate(asked):  # the answer: a space, then the key's digits
            rows.append({"probe": "passkey", "sample": sample, "question": number, "position": at,
                         "digit_loss": span_loss(losses, at + 1, min(at + 6, len(tokens)))})
    return rows


def copy_rows(model, tokenizer, seed: int) -> list:
    rng, rows = np.random.default_rng(seed), []
    for name, alphabet in (("repeat_digits", "0123456789"), ("repeat_letters", "abcdefghijklmnopqrstuvwxyz")):
        string = "".join(rng.choice(list(alphabet), 200))
        losses = token_losses(model, tokenizer.encode(string + "\n" + string))
        rows.append({"probe": name, "first_copy_loss": span_loss(losses, 1, 200),
                     "second_copy_loss": span_loss(losses, 201, 401)})
    at = CODE.rindex("compute_total")  # byte tokens: characters are positions
    losses = token_losses(model, tokenizer.encode(CODE))
    rows.append({"probe": "identifier", "second_use_loss": span_loss(losses, at + 1, at + len("compute_total"))})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="HF model directory (byte tokens)")
    parser.add_argument("--data", required=True, help="corpus folder: its heldout.parquet is the filler")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="copy_probe.json")
    args = parser.parse_args()
    model = load_model(args.model, torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer("bytes")
    filler = heldout_stream(data_spec(f"{args.data}/heldout.parquet"), tokenizer, 4 * args.length)
    rows = passkey_rows(model, tokenizer, filler, args.length, args.questions, args.samples, args.seed) \
        + copy_rows(model, tokenizer, args.seed)
    for row in rows:
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    print(f"(a uniform guess among digits: {math.log(10):.2f} nats)")
    write_result("copy_probe", vars(args), rows, path=args.out)


if __name__ == "__main__":
    main()
