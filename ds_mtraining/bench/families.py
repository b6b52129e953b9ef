"""``python -m ds_mtraining.bench.families``: the model-family matrix (:mod:`ds_mtraining.families`)
on one GPU, in bf16: per family, the loss and one forward+backward of the same model (same
random weights, same random tokens) with torch SDPA (transformers' ``"sdpa"``, windows included)
and with MTraining, twice: on the full causal index through MTraining's kernels (the loss must
match SDPA's to bf16 rounding) and on its own estimated index (``--sparse``, the loss then
differs by what the index leaves out; its density is recorded).

Each family runs at its public models' head_dim where the CUDA kernels take it (Phi-3's 96
zero-padded to 128), else at 128 (Gemma-3-27B's and Gemma-2-27B's), ``--layers`` layers of 8 query and 2 key/value heads, the
windowed families at ``--window`` tokens; a refused family is recorded with its one line.

Writes ``OUT/families_<tag>.json`` and prints a table. ``--examples_log LOG`` adds to that file
instead what ``scripts/families_check.sh``'s examples stage logged (each documented command, its
exit code and its loss lines), as its ``examples`` (with their own date, command and commit).

    python -m ds_mtraining.bench.families --seq_len 32768 --out benchmarks/results --tag h200
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..config import SparseConfig
from ..families import FAMILIES, Family, public_shape_config, refusal
from ..ops import CUDA_HEAD_DIMS
from ..record import result_record, write_json
from ..static import StaticPattern
from ..step import new_step
from . import fresh_output_dir, params_of, time_ms
from .e2e import device_name, device_tag

FALLBACK_HEAD_DIM = 128


def family_run_config(fam: Family, args):
    head_dim = fam.public_head_dim if fam.public_head_dim <= max(CUDA_HEAD_DIMS) else FALLBACK_HEAD_DIM
    config = public_shape_config(fam, layers=args.layers, head_dim=head_dim, window=args.window)
    return config, head_dim


def measure(fam: Family, args) -> dict:
    """One family's row: SDPA, MTraining on the full index and on its estimated one."""
    from transformers import AutoModelForCausalLM
    from ..hf import use_mtraining_attention
    from ..layer import AttentionStats, MTrainingAttentionSettings
    from ..training.model import MTrainingCausalLM
    config, head_dim = family_run_config(fam, args)
    row = {"family": fam.name, "config": fam.config_class, "public_head_dim": fam.public_head_dim,
           "head_dim": head_dim, "layer_types": getattr(config, "layer_types", None),
           "sliding_window": getattr(config, "sliding_window", None)}
    refused = refusal(config, "cuda")
    if refused is not None:
        return {**row, "refused": refused}
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, config.vocab_size, (1, args.seq_len + 1), generator=generator).cuda()
    inputs, labels = ids[:, :-1], ids[:, 1:]
    positions = torch.arange(args.seq_len, device="cuda")[None]

    def build(attention: str):
        torch.manual_seed(args.seed)
        return AutoModelForCausalLM.from_config(config, attn_implementation=attention).to("cuda", torch.bfloat16)

    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
    if MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._supports_sdpa:
        reference = build("sdpa")
        reference_loss = lambda: torch.nn.functional.cross_entropy(  # noqa: E731 (MTraining's loss, as a mean)
            reference(input_ids=inputs, use_cache=False).logits[0].float(), labels[0])
        row["sdpa"] = {"loss": reference_loss().item(), "fwd_bwd_ms": time_ms(lambda: reference_loss().backward(),
                                                                               warmup=1, repeats=args.repeats)}
        del reference
    else:  # (gpt-oss: its sinks have no SDPA path; its eager one does not fit at 32K)
        row["sdpa"] = None
        row["note"] = "transformers has no SDPA attention for this model: no reference here (tests/test_cuda_families.py)"
    for name, sparse, pattern in (
            ("mtraining_full_index", SparseConfig(block_size=args.block), StaticPattern(window_tokens=args.seq_len,
                                                                                        sink_tokens=0)),
            ("mtraining_sparse", SparseConfig(block_size=args.block), None)):
        model = build("eager")
        stats = AttentionStats()
        use_mtraining_attention(model, MTrainingAttentionSettings(sparse, stats=stats, pattern=pattern), "cuda")
        wrapper = MTrainingCausalLM(model, None, loss_chunk_tokens=4096)
        loss = lambda: wrapper(inputs, labels, positions)  # noqa: E731
        value = loss().item()
        new_step()
        stats.reset()
        loss()
        density = stats.summary()["density"]  # the global layers' (windowed layers are not estimated)
        density = None if density != density else density  # NaN: every layer windowed
        row[name] = {"loss": value, "fwd_bwd_ms": time_ms(lambda: loss().backward(), warmup=1, repeats=args.repeats),
                     "density": density, "loss_over_sdpa": value / row["sdpa"]["loss"] if row["sdpa"] else None}
        del model, wrapper
        torch.cuda.empty_cache()
    if row["sdpa"]:
        row["speedup_sparse_over_sdpa"] = row["sdpa"]["fwd_bwd_ms"] / row["mtraining_sparse"]["fwd_bwd_ms"]
    return row


def table(record: dict) -> str:
    lines = [f"{'family':28} {'D':>4} {'sdpa loss':>10} {'full-index':>10} {'sparse':>10} {'density':>8} "
             f"{'sdpa ms':>8} {'full ms':>8} {'sparse ms':>9}"]
    for row in record["rows"]:
        if "refused" in row:
            lines.append(f"{row['family']:28} {row['head_dim']:>4} refused: {row['refused'][:100]}")
            continue
        s = row["sdpa"] or {"loss": float("nan"), "fwd_bwd_ms": float("nan")}
        f, m = row["mtraining_full_index"], row["mtraining_sparse"]
        lines.append(f"{row['family']:28} {row['head_dim']:>4} {s['loss']:>10.4f} {f['loss']:>10.4f} {m['loss']:>10.4f} "
                     f"{m['density'] or float('nan'):>8.3f} {s['fwd_bwd_ms']:>8.1f} {f['fwd_bwd_ms']:>8.1f} {m['fwd_bwd_ms']:>9.1f}")
    return "\n".join(lines)


def examples_record(log: str) -> list[dict]:
    """Each ``=== deepspeed ...`` command of the examples stage's log, its exit code and loss lines."""
    runs = []
    for line in log.splitlines():
        if line.startswith("=== deepspeed "):
            runs.append({"command": line.removeprefix("=== "), "exit_code": None, "losses": [], "warnings": []})
        elif runs and line.startswith("=== exit "):
            runs[-1]["exit_code"] = int(line.removeprefix("=== exit "))
        elif runs and ('"loss"' in line or "'loss'" in line):
            runs[-1]["losses"].append(line.strip())
        elif runs and "UserWarning: ds_mtraining:" in line:
            runs[-1]["warnings"].append(line.split("UserWarning: ", 1)[1].strip())
    return runs


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ds_mtraining.bench.families", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seq_len", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--window", type=int, default=4096, help="the windowed families' sliding_window")
    parser.add_argument("--block", type=int, default=128, help="MTraining's block (sparse.block_size)")
    parser.add_argument("--families", nargs="*", default=None, help="names from ds_mtraining.families (default: all)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default=None, help="results folder (default bench_results/families-<time>)")
    parser.add_argument("--tag", default=None, help="families_<tag>.json (default: the device, e.g. h200x1)")
    parser.add_argument("--examples_log", default=None, help="record this examples-stage log instead (no GPU needed)")
    parser.add_argument("--device", default=None, help="with --examples_log: the GPU the log comes from")
    args = parser.parse_args(argv)
    if args.examples_log:
        if not (args.out and args.tag and args.device):
            parser.error("--examples_log needs --out, --tag and --device (the machine that ran it)")
    elif not torch.cuda.is_available():
        parser.error("bench.families measures the CUDA kernels: it needs a GPU (tests/test_families.py is the CPU check)")
    args.device = args.device or device_name(False)
    args.tag = args.tag or device_tag(args.device, False, 1)
    args.out = args.out or str(fresh_output_dir("families"))
    args.command = " ".join(["python -m ds_mtraining.bench.families", *(argv if argv is not None else sys.argv[1:])])
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.examples_log:
        runs = examples_record(Path(args.examples_log).read_text())
        path = Path(args.out) / f"families_{args.tag}.json"
        stamp = dict(device=args.device, command=args.command)
        record = json.loads(path.read_text()) if path.is_file() else result_record("families", params_of(args), [],
                                                                                   **stamp)
        record["examples"] = result_record("families_examples", params_of(args), runs, **stamp)
        write_json(path, record)
        print(f"families: {sum(r['exit_code'] == 0 for r in runs)} of {len(runs)} documented commands exited 0; {path}")
        return record
    families = [f for f in FAMILIES if args.families is None or f.name in args.families]
    record = result_record("families", params_of(args), [], device=args.device, command=args.command,
                           seq_len=args.seq_len, layers=args.layers, window=args.window, block=args.block,
                           dtype="bfloat16")
    path = Path(args.out) / f"families_{args.tag}.json"
    for fam in families:
        print(f"families: {fam.name} ...", flush=True)
        try:
            record["rows"].append(measure(fam, args))
        except Exception as error:  # one family's failure is a result, the others still run
            record["rows"].append({"family": fam.name, "error": f"{type(error).__name__}: {error}"[:2000]})
            print(f"families:     failed: {record['rows'][-1]['error'][:300]}", flush=True)
        torch.cuda.empty_cache()
        write_json(path, record)  # what has run so far survives a cut-off call
    print(table({"rows": [r for r in record["rows"] if "error" not in r]}))
    print(f"families: results in {path}", flush=True)
    return record


if __name__ == "__main__":
    main()
