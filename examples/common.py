"""What the example scripts share: their arguments, the model (a ds_mtraining preset with random
weights, e.g. ``qwen2.5-3b``, or a local HF model directory) and a dataset of random token
sequences in the usual HF form (``input_ids`` and ``labels``, not shifted)."""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from ds_mtraining.training.memory import enable_checkpointing
from ds_mtraining.training.model import build_model as build_preset, random_init_device


def parse_args(argv, description):
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON (HF Trainer: 'auto' values allowed)")
    parser.add_argument("--model", default="small-qwen2", help="a ds_mtraining preset or a local HF model directory")
    parser.add_argument("--layers", type=int, default=None, help="override the model's depth")
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--bf16", action="store_true", help="HF Trainer only (the JSON's 'auto'): train in bfloat16")
    parser.add_argument("--learning_rate", type=float, default=1e-4, help="HF Trainer only (the JSON's 'auto')")
    parser.add_argument("--max_grad_norm", type=float, default=1.0, help="HF Trainer only (the JSON's 'auto')")
    parser.add_argument("--output_dir", default="runs/example", help="HF Trainer only")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args(argv)


def build_model(args):
    """The model, seeded and placed as ds_mtraining.train builds it (fp32; DeepSpeed's bf16 casts it)."""
    torch.manual_seed(args.seed)
    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    spec = {"name_or_path": args.model, "config_overrides": overrides}
    device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"
    model = build_preset(spec, random_init_device(spec, device))
    if args.gradient_checkpointing:
        enable_checkpointing(model)  # transformers' own, under the name this transformers has
    return model


class RandomTokens(torch.utils.data.Dataset):
    """``samples`` sequences of ``seq_len`` uniformly random token ids, seeded per sample."""

    def __init__(self, seq_len, vocab_size, samples=1024, seed=0):
        self.seq_len, self.vocab_size, self.samples, self.seed = seq_len, vocab_size, samples, seed

    def __len__(self):
        return self.samples

    def __getitem__(self, i):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        ids = torch.randint(0, self.vocab_size, (self.seq_len,), generator=generator)
        return {"input_ids": ids, "labels": ids.clone()}


def report(step, loss, tokens, started):
    """One JSON line per step on rank 0 (loss, tokens/s); returns the loss as a float."""
    loss = float(loss.detach())
    if not dist.is_initialized() or dist.get_rank() == 0:
        seconds = time.perf_counter() - started
        print(json.dumps({"step": step + 1, "loss": round(loss, 6), "tokens_per_s": round(tokens / seconds, 1),
                          "step_s": round(seconds, 4)}), flush=True)
    return loss


def world_size():
    return int(os.environ.get("WORLD_SIZE", "1"))
