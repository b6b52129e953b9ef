"""Train a causal LM with MTraining attention under the DeepSpeed launcher.

    deepspeed --num_gpus 2 --module ds_mtraining.train --deepspeed_config ds_configs/cpu_demo.json \\
        --steps 20 --save_dir runs/demo
    deepspeed --hostfile hosts --module ds_mtraining.train --deepspeed_config ... [--resume]

The DeepSpeed JSON carries, besides DeepSpeed's own settings (ZeRO, offload, optimizer,
precision, monitors), an ``"mtraining"`` section, removed before the JSON reaches DeepSpeed::

    "mtraining": {
      "seq_len": 4096,                  # tokens per sample (global, before striping)
      "sequence_parallel_size": 2,      # ranks sharing one sequence (divides the world size)
      "ring": "auto",                   # flat | hierarchical | auto (hierarchical across nodes)
      "stripe_block": 64,               # stripe width = kernel block (64 or 128)
      "sparse": {"p_vertical": 0.9, ...},   # ds_mtraining.SparseConfig fields
      "model": "tiny-qwen2",            # preset, local model dir, or {"name_or_path", "config_overrides"}
      "tokenizer": "bytes",             # "model" (the model directory's own) or a tokenizer directory
      "data": {"source": "stdlib"},     # or {"files": [...]} or {"saved_dataset": dir}
      "loss_chunk_tokens": 1024,        # rows per chunk of the LM-head cross-entropy
      "gradient_checkpointing": false   # recompute each decoder layer in backward (long sequences)
    }

Everything is validated before any process group exists; a bad value is one error naming its key
and the fix. Checkpoints (``--save_dir``, every ``--save_interval`` steps) go through
``engine.save_checkpoint`` with the step, the data position and every rank's RNG states in the
client state; ``--resume`` continues from the latest one so that the following losses equal an
uninterrupted run's.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ds_mtraining.data import (DataConfigError, PackedSequences, RankBatches, datasets_offline,
                               load_documents, load_tokenizer, tokenize_documents)
from ds_mtraining.distributed import ParallelConfigError, initialize_groups
from ds_mtraining.training import MTRAINING_KEY, ConfigError
from ds_mtraining.training.checkpoint import resume_checkpoint, save_checkpoint
from ds_mtraining.training.model import MTrainingCausalLM, build_model
from ds_mtraining.training.progress import Progress, describe_run, monitor_dir, with_default_monitor
from ds_mtraining.training.run_config import load_run_config


def parse_args(argv=None):
    import deepspeed
    parser = argparse.ArgumentParser(description="Train a causal LM with MTraining sparse ring attention.")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to reach")
    parser.add_argument("--save_dir", default="runs/mtraining", help="checkpoints (and default metrics)")
    parser.add_argument("--save_interval", type=int, default=0, help="checkpoint every N steps (0: at the end)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save_dir")
    parser.add_argument("--model", default=None, help="override mtraining.model (preset or local dir)")
    parser.add_argument("--data", default=None,
                        help="override mtraining.data: 'stdlib', a saved dataset dir, or comma-separated files")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--log_interval", type=int, default=1)
    parser.add_argument("--no_progress", action="store_true", help="no progress output")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    if not args.deepspeed_config:
        parser.error("--deepspeed_config is required (see ds_configs/)")
    for name in ("steps", "log_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    return args


def train(args) -> dict:
    import deepspeed
    from ds_mtraining.hf import use_mtraining_attention
    from ds_mtraining.layer import AttentionStats, MTrainingAttentionSettings

    datasets_offline()
    world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    run, ds_config = load_run_config(args.deepspeed_config, world_size, args.model, args.data)
    ds_config = with_default_monitor(ds_config, args.save_dir)

    deepspeed.init_distributed()
    groups = initialize_groups(run.sequence_parallel_size, run.ring)

    torch.manual_seed(args.seed)
    model = build_model(run.model)
    stats = AttentionStats(enabled=False)
    use_mtraining_attention(model, MTrainingAttentionSettings.from_groups(run.sparse, groups, stats))
    if run.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    module = MTrainingCausalLM(model, groups.sequence_group, run.loss_chunk_tokens).train()

    engine, _, _, _ = deepspeed.initialize(model=module, config=ds_config, mpu=groups,
                                           model_parameters=[p for p in module.parameters() if p.requires_grad])
    micro_batch = engine.train_micro_batch_size_per_gpu()
    accumulation = engine.gradient_accumulation_steps()
    tokenizer = load_tokenizer(run.tokenizer)
    documents = load_documents(run.data, key=f"{MTRAINING_KEY}.data")
    samples = PackedSequences(tokenize_documents(documents, tokenizer), run.seq_len)
    batches = RankBatches(samples, micro_batch, groups.get_data_parallel_rank(),
                          groups.get_data_parallel_world_size(), groups.get_sequence_parallel_rank(),
                          run.sequence_parallel_size, run.sparse.block_size, args.seed)

    step, position = 0, 0
    if args.resume:
        step, position = resume_checkpoint(engine, args.save_dir, run)
    progress = Progress(args.steps, step, enabled=dist.get_rank() == 0 and not args.no_progress)
    progress.print(describe_run(run, groups))
    if args.resume:
        progress.print(f"resumed from {args.save_dir} at step {step} (data position {position})")
    tokens_per_step = micro_batch * accumulation * groups.get_data_parallel_world_size() * run.seq_len
    history = []
    while step < args.steps:
        started = time.perf_counter()
        stats.reset()
        stats.enabled = (step + 1) % args.log_interval == 0
        losses = []
        for micro in range(accumulation):
            batch = batches.batch(position)
            position += 1
            loss = engine(**{k: v.to(engine.device) for k, v in batch.items()})
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
            stats.enabled = False
        step += 1
        mean_loss = torch.stack(losses).mean()
        dist.all_reduce(mean_loss, group=groups.data_group)
        mean_loss = float(mean_loss) / groups.get_data_parallel_world_size()
        elapsed = time.perf_counter() - started
        history.append(mean_loss)
        if step % args.log_interval == 0:
            metrics = {"loss": mean_loss, "tokens_per_s": tokens_per_step / elapsed,
                       "lr": engine.get_lr()[0], **stats.summary()}
            engine.monitor.write_events([(f"Train/mtraining/{k}", v, step) for k, v in metrics.items()])
            progress.update(step, metrics)
        if args.save_interval and step % args.save_interval == 0 or step == args.steps:
            save_checkpoint(engine, args.save_dir, step, position, run)
    progress.close()
    progress.print(f"checkpoint: {Path(args.save_dir).resolve()} (tag step{step})")
    where = monitor_dir(ds_config)
    if where:
        progress.print(f"metrics:    {Path(where).resolve()}")
    return {"losses": history, "step": step}


def main(argv=None):
    args = parse_args(argv)
    try:
        train(args)
    except (ConfigError, DataConfigError, ParallelConfigError) as error:
        print(f"ds_mtraining.train: configuration error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
