"""Loss benchmark: the LM head and cross-entropy of one GPU's tokens, forward and backward, the
project's chunked torch loss against liger-kernel's fused linear cross-entropy, both through
:func:`ds_mtraining.loss.token_cross_entropy_sum` (``fused=False``/``True``) as training calls it,
same inputs, same run.

Per token count (a GPU's share of the sequence; Qwen2.5's LM head by default: hidden 2048,
vocabulary 151936, bf16), times forward+backward with CUDA events (median after warm-up) and the
peak memory it allocates beyond its inputs, for our loss at each ``--chunk-tokens`` and for liger.
Agreement: the loss and both gradients of every implementation against a float64 reference on the
first ``--check-tokens`` tokens (relative error of the loss, relative norm error of each gradient).
Prints a table; writes JSON to a fresh directory (``bench_results/loss-<time>``) unless ``--out``
names a file or directory.

    python -m ds_mtraining.bench.loss [--tokens 131072 262144] [--chunk-tokens 1024 4096] [--out DIR]
    python -m ds_mtraining.bench.loss --device cpu --tokens 512 --vocab 1024 --hidden 64 --check-tokens 256
"""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch

from ..loss import IGNORE_INDEX, token_cross_entropy_sum
from ..record import result_record, write_json
from . import command_of, fresh_output_dir, params_of, time_ms, wall_time_ms


def implementations(chunk_tokens: list[int], device: str) -> dict:
    """name -> fn(hidden, weight, labels) returning the summed loss (differentiable)."""
    found = {f"chunked_{n}": (lambda h, w, y, n=n: token_cross_entropy_sum(h, w, y, n)) for n in chunk_tokens}
    if device.startswith("cuda") and importlib.util.find_spec("liger_kernel") is not None:
        found["liger"] = lambda h, w, y: token_cross_entropy_sum(h, w, y, fused=True)
    return found


def inputs(tokens: int, hidden: int, vocab: int, dtype, device, seed: int = 0):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    h = (torch.randn(tokens, hidden, generator=generator) * 0.5).to(device, dtype)
    w = (torch.randn(vocab, hidden, generator=generator) * hidden ** -0.5).to(device, dtype)
    y = torch.randint(0, vocab, (tokens,), generator=generator).to(device)
    y[::97] = IGNORE_INDEX  # some ignored labels, as padding and document ends give
    return h, w, y


def fwd_bwd(fn, h, w, y):
    h = h.detach().requires_grad_()
    w = w.detach().requires_grad_()
    loss = fn(h, w, y)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def agreement(fn, h, w, y) -> dict:
    """Relative errors of the loss and both gradients against float64 torch."""
    ref = fwd_bwd(lambda a, b, c: torch.nn.functional.cross_entropy(a @ b.T, c, reduction="sum"),
                  h.double(), w.double(), y)
    got = fwd_bwd(fn, h, w, y)
    errors = {}
    for name, mine, theirs in zip(("loss", "grad_hidden", "grad_weight"), got, ref):
        errors[name] = float((mine.double() - theirs).norm() / theirs.norm().clamp_min(1e-300))
    return errors


def run_case(tokens: int, args, impls: dict) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    h, w, y = inputs(tokens, args.hidden, args.vocab, dtype, device)
    check = min(args.check_tokens, tokens)
    case = {"tokens": tokens, "results": {}}
    for name, fn in impls.items():
        row = {"errors_vs_float64": agreement(fn, h[:check], w, y[:check])}
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            row["fwd_bwd_ms"] = time_ms(lambda: fwd_bwd(fn, h, w, y), warmup=2, repeats=args.repeats)
            row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
        else:
            row["fwd_bwd_ms"] = wall_time_ms(lambda: fwd_bwd(fn, h, w, y), args.repeats)
        flops = 3 * 2 * tokens * args.hidden * args.vocab  # logits, grad hidden, grad weight
        row["tflops"] = flops / row["fwd_bwd_ms"] / 1e9
        case["results"][name] = row
        print(f"  {tokens:>8} {name:<14} {row['fwd_bwd_ms']:9.2f} ms {row['tflops']:7.1f} TFLOP/s "
              f"extra {row.get('peak_extra_gib', float('nan')):6.2f} GiB  "
              + " ".join(f"{k} {v:.1e}" for k, v in row["errors_vs_float64"].items()), flush=True)
    fastest = min(case["results"], key=lambda n: case["results"][n]["fwd_bwd_ms"])
    case["fastest"] = fastest
    if "liger" in case["results"]:
        liger_ms = case["results"]["liger"]["fwd_bwd_ms"]
        case["liger_over_chunked"] = {n: r["fwd_bwd_ms"] / liger_ms for n, r in case["results"].items()
                                      if n != "liger"}
    return case


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[131072, 262144], help="tokens on the GPU")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunk-tokens", type=int, nargs="+", default=[1024, 4096],
                        help="our loss's chunk sizes (training's mtraining.loss_chunk_tokens)")
    parser.add_argument("--check-tokens", type=int, default=2048, help="tokens checked against float64")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="JSON file, or directory for loss.json")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA GPU; pass --device cpu")
    impls = implementations(args.chunk_tokens, args.device)
    if "liger" not in impls:
        print("liger-kernel's fused linear cross-entropy: not run (needs liger-kernel and a CUDA GPU)")
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"loss fwd+bwd on {device_name}: hidden {args.hidden}, vocabulary {args.vocab}, {args.dtype}")
    cases = [run_case(tokens, args, impls) for tokens in args.tokens]
    out = args.out or fresh_output_dir("loss")
    if out.suffix != ".json":
        out.mkdir(parents=True, exist_ok=True)
        out = out / "loss.json"
    result = result_record("loss", params_of(args), cases, device=device_name,
                           command=command_of("ds_mtraining.bench.loss", argv), torch=torch.__version__,
                           shape={"hidden": args.hidden, "vocab": args.vocab, "dtype": args.dtype})
    write_json(out, result)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
