"""When does a byte-level model start to copy passkeys? A small Qwen2 trained from scratch on passkey
samples of one recipe, with the loss of the key's copies measured as it trains (runs on a CPU).

A passkey training sample (:func:`ds_mtraining.passkey.passkey_training_sample`) holds its key
``2 + questions`` times: twice in the needle ("The pass key is K. Remember it. K is the pass
key."), then after each question. Every copy after the first is predictable only by copying, so
until the model has learned to copy (an induction head) it puts ln 10 = 2.30 nats on each of their
digits, a uniform guess, however low the loss on the text is. The learning is abrupt: the loss
stays at ln 10 for a while, then falls, first on the needle's second copy (a few tokens back), then
on the answers. This is the 128K quality study's plateau (docs/RESULTS.md, under the 128K row):
its 4K and 32K models answered every key with the same digits, and its copy probe
(``copy_probe.py``) found them at ln 10 on every answer. A recipe that ends its dense stages
before the onset trains a model that retrieves nothing, whatever the attention.

Every ``--eval_every`` steps, on a fixed batch of samples whose keys and depths the run never trains on (an epoch of their own): the mean loss of
the digits of the needle's second copy (``needle_copy``) and of the answers (``answers``), and the
whole batch's loss. ``onset_step``: the first evaluation with the answers under ``--onset_nats``. The model
trains through transformers' own loss and torch SDPA, with none of the project's training code:
this measures the task and the recipe, not the training path (the GPU tests check that path
against the float32 model: ``tests/test_cuda_liger.py``).

    python3 benchmarks/probes/copy_onset.py --seq_len 512 --questions 4 --lr 3e-3 --steps 1500
        [--batch 16] [--layers 2] [--hidden 128] [--data data/quality]
        [--out copy_onset.json]

On 2 CPU cores (one thread) a run of that size takes about 90 s per 100 steps.
"""
import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch

from ds_mtraining.data import PackedSequences, load_documents, load_tokenizer, tokenize_documents
from ds_mtraining.eval.runtime import data_spec
from ds_mtraining.passkey import DEFAULT_DIGITS, NEEDLE
from ds_mtraining.record import write_result

EVAL_SEED = 1 << 20  # the evaluation batch's samples come from their own epoch: never trained on


def build_model(args):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    heads = max(2, args.hidden // 32)
    config = Qwen2Config(vocab_size=257, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                         intermediate_size=2 * args.hidden, rope_theta=1e6, max_position_embeddings=1 << 20,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    return Qwen2ForCausalLM(config)


def key_copies(tokenizer, tokens: np.ndarray) -> list[np.ndarray]:
    """Positions in ``tokens`` of each copy of the sample's key after the first (the needle's second
    copy first, then the answers), found from the needle's text."""
    head = tokenizer.encode(NEEDLE.split("{key}")[0])
    tokens = tokens.tolist()
    start = next(i + len(head) for i in range(len(tokens)) if tokens[i:i + len(head)] == list(head))
    key = tokens[start:start + DEFAULT_DIGITS]
    return [np.arange(i, i + len(key)) for i in range(start + 1, len(tokens) - len(key) + 1)
            if tokens[i:i + len(key)] == key]


def evaluate(model, samples, tokenizer, ids) -> dict:
    pairs = [samples.sample(int(i), EVAL_SEED) for i in ids]
    x, y = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    with torch.no_grad():
        losses = torch.nn.functional.cross_entropy(model(input_ids=x).logits.float().transpose(1, 2), y,
                                                   reduction="none")
    needle, answers = [], []
    for row, (inputs, labels) in enumerate(pairs):
        copies = key_copies(tokenizer, torch.cat([inputs[:1], labels]).numpy())
        # token t of the sample is the label of position t - 1
        needle += losses[row, copies[0] - 1].tolist()
        answers += [value for copy in copies[1:] for value in losses[row, copy - 1].tolist()]
    return {"loss": float(losses.mean()), "needle_copy": float(np.mean(needle)), "answers": float(np.mean(answers))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--data", default=None,
                        help="corpus folder (its train.parquet) or file; default: the first 40 standard-library documents")
    parser.add_argument("--eval_every", type=int, default=100)
    parser.add_argument("--eval_samples", type=int, default=16)
    parser.add_argument("--onset_nats", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="copy_onset.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer("bytes")
    if args.data is None:
        spec = {"source": "stdlib", "max_documents": 40}
    else:  # a corpus folder's training half only (data_spec would read its held-out file too)
        spec = data_spec(str(Path(args.data) / "train.parquet") if Path(args.data).is_dir() else args.data)
    samples = PackedSequences(tokenize_documents(load_documents(spec), tokenizer), args.seq_len, 1.0, tokenizer,
                              args.seed, args.questions)
    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup))
    rng = np.random.default_rng(args.seed)
    eval_ids = rng.integers(0, len(samples), args.eval_samples)
    rows, onset, start = [], None, time.time()
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            rows.append({"step": step, **evaluate(model, samples, tokenizer, eval_ids), "s": time.time() - start})
            print({k: round(v, 3) for k, v in rows[-1].items()}, flush=True)
            if onset is None and rows[-1]["answers"] < args.onset_nats:
                onset = step
        if step == args.steps:
            break
        pairs = [samples.sample(int(i), step) for i in rng.integers(0, len(samples), args.batch)]
        inputs, labels = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        loss = torch.nn.functional.cross_entropy(model(input_ids=inputs).logits.flatten(0, 1), labels.flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    copies = args.batch * (args.questions + 1) * DEFAULT_DIGITS  # copied digits a step trains on
    print(f"onset (answers under {args.onset_nats} nats): step {onset}; {copies} copied digits a step; "
          f"a uniform guess among digits: {math.log(10):.2f} nats")
    write_result("copy_onset", vars(args), rows, path=args.out, onset_step=onset, copied_digits_per_step=copies)


if __name__ == "__main__":
    main()
