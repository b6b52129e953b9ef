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
      "data": {"source": "stdlib"},     # or {"files": [...]}, {"saved_dataset": dir}, {"source": "random"}
      "loss_chunk_tokens": 1024,        # rows per chunk of the LM-head cross-entropy
      "gradient_checkpointing": false,  # recompute each decoder layer in backward (long sequences)
      "keep_attention_output": false,   # with checkpointing: keep each layer's attention output for
                                        # the recompute (attention once per layer; memory per layer)
      "attention": "sparse",            # sparse (MTraining) | dense | static (baselines, same path)
                                        # | ulysses (dense HF SDPA under DeepSpeed-Ulysses)
      "static": {"density": 0.1, "sink_tokens": 4},  # attention "static" only (or "window_tokens")
      "document_masking": true,         # default: on where the data packs documents (not "random",
                                        # not ulysses); RoPE positions restart per document
      "liger": "auto",                  # liger-kernel RMSNorm/RoPE/SwiGLU and loss on CUDA where installed
      "dense_backend": "auto",          # dense and ulysses: sdpa | fa4 (FlashAttention-4) | auto (by GPU)
      "stall_timeout_s": 600,           # a rank without progress this long stops the job, named; 0: off
      "max_nonfinite_steps": 0,         # non-finite steps in a row let pass before the run stops
      "memory": {                       # ds_mtraining.training.memory; the defaults aim at the longest length
        "tiled_mlp": "auto",            # the MLP over token chunks (auto: where a rank holds >= 2 chunks)
        "mlp_chunk_tokens": 16384,
        "offload_checkpoints": "auto",  # checkpointed layer inputs of the first N layers to pinned host
                                        # memory: auto (as many as the host holds) | all | none | N
        "host_reserve_gib": "auto",     # host memory the check leaves free: auto = min(8, a tenth)
        "expandable_segments": true     # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless set
      }
    }

``"attention": "ulysses"`` is the baseline users run today: the model's own dense attention (torch
SDPA with its own dispatch, or FlashAttention-4 with ``dense_backend``) under DeepSpeed-Ulysses over the
``sequence_parallel_size`` ranks (at 1: plain dense attention), on contiguous shards of the same
samples, with the same loss, engine and groups (:func:`ds_mtraining.hf.use_ulysses_attention`). Each
logged step also records, on CUDA, every rank's peak allocated memory (``peak_memory_gib``: the
largest; ``peak_memory_gib_rank<r>``), the memory allocated between steps (``resident_memory_gib``),
and on every device the host memory summed over the ranks (``host_rss_gib``, ``host_peak_rss_gib``)
and the GiB of checkpoints offloaded (``offloaded_gib``). The run's first line says each memory
setting and the host check's numbers (``SAVE_DIR/memory_plan.json``: the analytic breakdown); a host
that cannot hold the CPU optimizer and the offloaded checkpoints stops the run before the engine
starts, and a CUDA out-of-memory error is one line with the length, the peak and the setting to try.

Everything is validated before any process group exists; a bad value is one error naming its key
and the fix. Checkpoints (``--save_dir``, every ``--save_interval`` steps) go through
``engine.save_checkpoint`` with the step, the data position and every rank's RNG states in the
client state; ``--resume`` continues from the latest one so that the following losses equal an
uninterrupted run's (the metrics CSVs drop the rows logged after that checkpoint).

Continued training: ``--model DIR`` loads a local HF checkpoint's weights; ``config_overrides``
may change ``rope_theta``, ``rope_scaling`` (or ``rope_parameters``) and
``max_position_embeddings``; ``--export_hf OUT`` writes the trained model (fp32 master weights
consolidated from the ZeRO partitions) with ``save_pretrained``, at the end of the run, or at once
with ``--resume`` from a checkpoint at ``--steps``. ``--data DIR`` reads a folder of
json/jsonl/parquet/arrow/csv files or a saved dataset.

Stopping: Ctrl-C. A rank that dies, a killed launcher or Ctrl-C end every rank within seconds
with one line naming the cause and the last checkpoint (:mod:`ds_mtraining.training.watchdog`);
SIGTERM or SIGUSR1 (preemption) finish the step in flight and save it first; a rank that makes no
progress for ``mtraining.stall_timeout_s`` stops the job, named (:mod:`ds_mtraining.training.heartbeat`);
a non-finite loss stops it with no later checkpoint (:mod:`ds_mtraining.training.step_checks`).
Ranks other than 0 print errors only.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def name_accelerator():
    """The accelerator named for DeepSpeed (:func:`ds_mtraining.training.placement.name_accelerator`).
    CPU ranks (``DS_ACCELERATOR=cpu``, also on a GPU machine) hide the GPUs from every library, so
    that nothing (liger, the peak-memory metric) reaches for one."""
    from ds_mtraining.training import placement
    placement.name_accelerator()
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


name_accelerator()  # before any import of DeepSpeed (training.memory imports it)

from ds_mtraining.data import DataConfigError, RankBatches, datasets_offline, load_tokenizer, training_samples
from ds_mtraining.distributed import ParallelConfigError, initialize_groups, shutdown
from ds_mtraining.distributed.shm import release_shm_buffer
from ds_mtraining.training import MTRAINING_KEY, ConfigError
from ds_mtraining.training.export import export_hf
from ds_mtraining.training.memory import CheckpointOffload, OutOfMemory, enable_checkpointing, host_memory_now, \
    out_of_memory_line, plan_memory, tile_mlps
from ds_mtraining.training.checkpoint import DiskFull, claim_save_dir, continue_metrics, record_files, \
    record_metrics, resume_checkpoint, save_checkpoint
from ds_mtraining.training.heartbeat import group_timeout
from ds_mtraining.training.model import (MTrainingCausalLM, build_model, model_config, random_init_device,
                                         use_fused_kernels)
from ds_mtraining.training.profile import describe, profile_path, profiled, summarise, write_summary
from ds_mtraining.training.progress import Progress, describe_run, monitor_dir, with_default_monitor
from ds_mtraining.training.run_config import ULYSSES, RunConfig, load_run_config
from ds_mtraining.training.step_checks import NonFinite, StepChecks
from ds_mtraining.training.watchdog import Watchdog


def launcher_rank() -> int:
    """This process's global rank as the launcher tells it (before any process group exists)."""
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def quiet_other_ranks(rank: int):
    """One copy of each message: ranks other than 0 keep errors only (datasets/transformers logging
    and progress bars, Python warnings, DeepSpeed's logger). Set before those libraries load."""
    if rank == 0:
        return
    import logging
    import warnings
    for name, value in (("HF_DATASETS_DISABLE_PROGRESS_BARS", "1"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
                        ("DATASETS_VERBOSITY", "critical"), ("TRANSFORMERS_VERBOSITY", "critical"),
                        ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")):
        os.environ[name] = value
    warnings.filterwarnings("ignore")
    logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)


def quiet_known_warnings():
    """Warnings every healthy run would print, not shown: DeepSpeed's WarmupLR warns when its own
    constructor reads the first rate, and torch 2.13 deprecates ``all_gather_into_tensor``, which
    DeepSpeed's ZeRO (and torch versions before ``all_gather_single``) still need."""
    import logging
    import warnings
    logging.getLogger("DeepSpeed").addFilter(
        lambda record: "get learning rate from scheduler before it has started" not in record.getMessage())
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated", category=FutureWarning)


def parse_args(argv=None):
    import deepspeed
    from dataclasses import fields
    parser = argparse.ArgumentParser(
        prog="deepspeed [--num_gpus N | --hostfile H] --module ds_mtraining.train",
        description="Train a causal LM with MTraining sparse ring attention, one process per rank under the "
                    "deepspeed launcher (e.g. deepspeed --num_gpus 2 --module ds_mtraining.train "
                    "--deepspeed_config ds_configs/cpu_demo.json --save_dir runs/demo).",
        epilog=f"MTraining's settings go in the DeepSpeed JSON's \"{MTRAINING_KEY}\" section: "
               + ", ".join(f.name for f in fields(RunConfig))
               + ". docs/CONFIG.md explains each, with its default; ds_configs/ holds working examples.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to reach")
    parser.add_argument("--save_dir", default="runs/mtraining", help="checkpoints (and default metrics)")
    parser.add_argument("--save_interval", type=int, default=0, help="checkpoint every N steps (0: at the end)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save_dir")
    parser.add_argument("--overwrite", action="store_true",
                        help="delete the checkpoints and metrics an earlier run left in --save_dir, then train "
                             "from step 0 (without it or --resume, such a --save_dir is refused)")
    parser.add_argument("--model", default=None,
                        help="override mtraining.model: a preset or a local HF model directory (weights loaded)")
    parser.add_argument("--data", default=None,
                        help="override mtraining.data: 'stdlib', a folder (json/jsonl/parquet/arrow/csv files "
                             "or a saved dataset), or comma-separated files")
    parser.add_argument("--export_hf", default=None, metavar="DIR",
                        help="at the end (or with --resume at the last step: at once) write the model with "
                             "save_pretrained to DIR, ZeRO partitions consolidated, loadable by from_pretrained")
    parser.add_argument("--seed", type=int, default=1234, help="model initialisation, data order and sampling")
    parser.add_argument("--log_interval", type=int, default=1, help="log (and print) the metrics every N steps")
    parser.add_argument("--profile_step", type=int, default=0, metavar="N",
                        help="profile step N (torch.profiler): its time by kind of work, per rank, in "
                             "SAVE_DIR/profile_stepN_rank<r>.json (0: none)")
    parser.add_argument("--no_progress", action="store_true", help="no progress output")
    parser.add_argument("--no_checkpoint", action="store_true",
                        help="save no checkpoint, not even at the end (benchmarks)")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    if not args.deepspeed_config:
        parser.error("--deepspeed_config is required (see ds_configs/)")
    for name in ("steps", "log_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    return args


def train(args, watchdog: Watchdog | None = None) -> dict:
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from ds_mtraining.hf import use_mtraining_attention, use_ulysses_attention
    from ds_mtraining.layer import AttentionStats, MTrainingAttentionSettings
    from ds_mtraining.static import attention_pattern

    startup = StartupClock()  # where a long start-up goes (a 3B model: minutes)
    datasets_offline()
    world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    run, ds_config = load_run_config(args.deepspeed_config, world_size, args.model, args.data)
    ds_config = with_default_monitor(ds_config, args.save_dir)
    claim_save_dir(args.save_dir, monitor_dir(ds_config), args.resume, args.overwrite, clear=local_rank() == 0)
    # before CUDA starts (the allocator setting) and before the optimizer takes host memory
    plan = plan_memory(run, ds_config, world_size)
    if launcher_rank() == 0:
        print(plan.describe(), flush=True)
    # the data before any process group: an empty or unreadable corpus is one line, not a hang
    tokenizer = load_tokenizer(run.tokenizer)
    samples = training_samples(run.data, run.seq_len, tokenizer, args.seed, model_config(run.model).vocab_size,
                               key=f"{MTRAINING_KEY}.data")

    # this rank's GPU before any collective (the watchdog's pid exchange runs before
    # deepspeed.initialize would set it; NCCL refuses a tensor on another device)
    check_local_device(get_accelerator())
    get_accelerator().set_device(local_rank())
    dense = dense_backend_of(run)  # on this rank's device, before any process group
    if dense is not None and launcher_rank() == 0:
        print(f"ds_mtraining: {dense.describe()}", flush=True)
    timeout = group_timeout(run.stall_timeout_s)  # every process group's, the default one's included
    with one_time_build("DeepSpeed's shm comm op", "about 40 s on 2 CPU cores", shm_op_cached()), \
            contextlib.redirect_stdout(io.StringIO()):  # (DeepSpeed's own build note)
        deepspeed.init_distributed(timeout=timeout)
    release_shm_buffer()
    load_attention_op(get_accelerator().device_name())  # before step 1, so its tokens/s leave the build out
    groups = initialize_groups(run.sequence_parallel_size, run.ring, timeout=timeout)
    if watchdog is not None:
        watchdog.know_peers(run.stall_timeout_s)
    at = watchdog.at if watchdog is not None else lambda phase: None  # progress marks: the stall detection's

    startup.done("config, data, process groups and ops")
    at("building the model")
    torch.manual_seed(args.seed)
    model = build_model(run.model, random_init_device(run.model, get_accelerator().current_device_name()))
    startup.done("model")
    fused_off = use_fused_kernels(model, run.liger)
    if launcher_rank() == 0:
        print("ds_mtraining: liger-kernel RMSNorm/RoPE/SwiGLU and fused linear cross-entropy: "
              + (f"off ({fused_off})" if fused_off else "on"))
    if plan.tiled_mlp:  # after liger: the tiles wrap liger's SwiGLU where it was applied
        tile_mlps(model, plan.mlp_chunk_tokens)
    stats = AttentionStats(enabled=False)
    ulysses = run.attention == ULYSSES
    if not ulysses:  # (Ulysses is registered below, once the micro-batch size is known)
        pattern = attention_pattern(run.attention, run.static)  # None (sparse) or a fixed baseline
        use_mtraining_attention(model, MTrainingAttentionSettings.from_groups(
            run.sparse, groups, stats, pattern, run.keep_attention_output, dense.name if dense else "sdpa"))
    if run.gradient_checkpointing:
        enable_checkpointing(model)
    module = MTrainingCausalLM(model, groups.sequence_group, run.loss_chunk_tokens,
                               fused_loss=fused_off is None).train()

    at("starting the engine")
    engine, _, _, _ = deepspeed.initialize(model=module, config=ds_config, mpu=groups,
                                           model_parameters=[p for p in module.parameters() if p.requires_grad])
    startup.done("DeepSpeed engine")
    if engine.device.type == "cuda":  # the fp32 weights of a random init on the GPU, now cast: not kept cached
        torch.cuda.empty_cache()
    micro_batch = engine.train_micro_batch_size_per_gpu()
    accumulation = engine.gradient_accumulation_steps()
    if ulysses:
        use_ulysses_attention(model, groups.sequence_ranks, micro_batch, run.seq_len, dense.name)
    batches = RankBatches(samples, micro_batch, groups.get_data_parallel_rank(),
                          groups.get_data_parallel_world_size(), groups.get_sequence_parallel_rank(),
                          run.sequence_parallel_size, run.sparse.block_size, args.seed, run.document_masking,
                          "contiguous" if ulysses else "striped")

    step, position = 0, 0
    if args.resume:
        at("loading the checkpoint")
        step, position = resume_checkpoint(engine, args.save_dir, run)
        continue_metrics(engine, args.save_dir, step)  # no second header, no step logged twice
    checks = StepChecks(engine, run.max_nonfinite_steps, args.steps, watchdog)
    if watchdog is not None:
        watchdog.step = step
        watchdog.preemptible = not args.no_checkpoint  # SIGTERM/SIGUSR1: save the step in flight, then stop
    progress = Progress(args.steps, step, enabled=dist.get_rank() == 0 and not args.no_progress)
    if dist.get_rank() == 0:
        Path(args.save_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.save_dir) / "memory_plan.json").write_text(json.dumps(plan.to_dict(), indent=1))
        (Path(args.save_dir) / "startup.json").write_text(json.dumps(startup.seconds, indent=1))
        record_files(args.save_dir, ["memory_plan.json", "startup.json"])
    offload = (CheckpointOffload(plan.offload_layers, plan.num_layers, engine.device.type == "cuda")
               if plan.offload_layers else contextlib.nullcontext())
    progress.print(describe_run(run, groups) + f"; {startup.describe()}")
    if args.resume:
        progress.print(f"resumed from {args.save_dir} at step {step} (data position {position})")
    tokens_per_step = micro_batch * accumulation * groups.get_data_parallel_world_size() * run.seq_len
    history = []
    while step < args.steps:
        started = time.perf_counter()
        stats.reset()
        stats.enabled = (step + 1) % args.log_interval == 0
        losses = []
        resident = resident_memory()
        try:
            with profiled(args.profile_step == step + 1) as profiler:
                for micro in range(accumulation):
                    at("loading data")
                    batch = batches.batch(position)
                    position += 1
                    with offload:  # the checkpointed inputs of the first N layers on the host
                        at("forward")
                        loss = engine(**{k: v.to(engine.device) for k, v in batch.items()})
                        at("backward")
                        engine.backward(loss)
                    at("optimizer step")
                    engine.step()
                    losses.append(loss.detach().float())
                    stats.enabled = False
        except torch.OutOfMemoryError as error:
            raise OutOfMemory(out_of_memory_line(error, run, plan, step + 1)) from None
        step += 1
        at("end of step")
        if profiler is not None:
            summary = summarise(profiler, step, dist.get_rank(), time.perf_counter() - started)
            write_summary(summary, args.save_dir)
            progress.print(describe(summary))
            if dist.get_rank() == 0:  # every rank's file, among the run's
                ranks = range(dist.get_world_size())
                record_files(args.save_dir, [profile_path(args.save_dir, step, r) for r in ranks])
        preempt = checks.after_step(step, losses)  # a signal on any rank; raises NonFinite
        mean_loss = torch.stack(losses).mean()
        dist.all_reduce(mean_loss, group=groups.data_group)
        mean_loss = float(mean_loss) / groups.get_data_parallel_world_size()
        elapsed = time.perf_counter() - started
        history.append(mean_loss)
        if step % args.log_interval == 0:
            metrics = {"loss": mean_loss, "tokens_per_s": tokens_per_step / elapsed,
                       "lr": engine.get_lr()[0], **({} if ulysses else stats.summary()), **peak_memory(),
                       **resident, **host_memory(engine.device), **offloaded(offload)}
            engine.monitor.write_events([(f"Train/mtraining/{k}", v, step) for k, v in metrics.items()])
            record_metrics(engine, args.save_dir)
            progress.update(step, metrics)
        due = args.save_interval and step % args.save_interval == 0 or step == args.steps or preempt
        seconds = None
        if not args.no_checkpoint and checks.save_due(bool(due)):
            at("checkpoint save")
            seconds = save_checkpoint(engine, args.save_dir, step, position, run)
        if watchdog is not None:
            watchdog.step = step
        if preempt:
            watchdog.preempted(preempt, seconds)
    if watchdog is not None:
        watchdog.preemptible = False
    progress.close()
    if args.export_hf:
        at("export")
        tokenizer_dir = None if run.tokenizer == "bytes" else run.tokenizer
        exported = export_hf(model, args.export_hf, tokenizer_dir)
        progress.print(f"exported:   {exported} (step {step}; AutoModelForCausalLM.from_pretrained)")
    if not args.no_checkpoint:
        progress.print(f"checkpoint: {Path(args.save_dir).resolve()} (tag step{step})")
    where = monitor_dir(ds_config)
    if where:
        progress.print(f"metrics:    {Path(where).resolve()}")
    if args.export_hf:  # the export is the step after the checkpoint: what comes next is its evaluation
        progress.print(f"next:       evaluate it: python -m ds_mtraining.eval {args.export_hf}"
                       + (f"; more steps: --resume --steps {2 * step}" if not args.no_checkpoint else ""))
    elif not args.no_checkpoint:
        progress.print(f"next:       more steps: --resume --steps {2 * step}; a Hugging Face model: --resume "
                       f"--steps {step} --export_hf DIR, then python -m ds_mtraining.eval DIR")
    return {"losses": history, "step": step, "model": model}  # (the model: for in-process callers, tests)


class StartupClock:
    """Seconds per start-up phase, in order (``done(phase)`` ends one)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, phase: str):
        now = time.perf_counter()
        self.seconds[phase] = now - self._last
        self._last = now

    def describe(self) -> str:
        parts = ", ".join(f"{phase} {seconds:.0f} s" for phase, seconds in self.seconds.items())
        return f"ready in {sum(self.seconds.values()):.0f} s ({parts})"


def dense_backend_of(run: RunConfig):
    """The resolved kernel of the dense and Ulysses baselines (:mod:`ds_mtraining.dense_backend`;
    None in the other modes): ``fa4`` where it cannot run is a ConfigError."""
    from ds_mtraining.dense_backend import DenseBackendError, resolve_dense_backend
    if run.attention not in ("dense", ULYSSES):
        return None
    try:
        return resolve_dense_backend(run.dense_backend, key=f"{MTRAINING_KEY}.dense_backend")
    except DenseBackendError as error:
        raise ConfigError(str(error)) from None


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


class DeviceError(RuntimeError):
    """This rank has no device of its own (reported by the rank that finds it)."""


def check_local_device(accelerator):
    """One line, not a CUDA traceback, when the launcher starts more ranks on a node than it has GPUs."""
    if accelerator.device_name() == "cpu":
        return
    count = accelerator.device_count()
    if local_rank() >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise DeviceError(f"local rank {local_rank()} has no GPU: this node has {count} usable "
                          f"GPU{'s' * (count != 1)}{f' (CUDA_VISIBLE_DEVICES={visible})' if visible else ''}; "
                          f"launch at most {count} rank{'s' * (count != 1)} per node (--num_gpus {count}), or "
                          f"run on CPU ranks with DS_ACCELERATOR=cpu")


def shm_op_cached() -> bool:
    """Whether DeepSpeed's shm comm op (built by ``init_distributed`` on CPU ranks) needs no build."""
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() != "cpu":
        return True
    try:
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
    except ImportError:  # a DeepSpeed without it: nothing to announce
        return True
    from ds_mtraining_op_builder import extension_root
    builder = ShareMemCommBuilder()
    return builder.is_compatible() is False or os.path.exists(
        os.path.join(extension_root(), builder.NAME, f"{builder.NAME}.so"))


@contextlib.contextmanager
def one_time_build(what: str, typical: str, cached: bool):
    """Rank 0 says what compiles (once per machine, then cached) before the silence, and how long it took."""
    say = not cached and launcher_rank() == 0
    if say:
        print(f"ds_mtraining: compiling {what} once ({typical}; cached for later runs) ...",
              flush=True)
    started = time.perf_counter()
    yield
    if say:
        print(f"ds_mtraining: compiled {what} in {time.perf_counter() - started:.0f} s", flush=True)


def load_attention_op(device: str):
    """MTraining's op for ``device`` loaded (JIT-compiled on first use, which the builder announces
    and times) by rank 0 first, then by the others from the cache: one compilation, one message."""
    from ds_mtraining.ops import op_module
    if dist.get_rank() != 0:
        dist.barrier()
    op_module(device)
    if dist.get_rank() == 0:
        dist.barrier()
def resident_memory() -> dict:
    """On CUDA, this rank's allocated memory between steps (weights, gradient buffers: what stays)."""
    return {"resident_memory_gib": torch.cuda.memory_allocated() / 2 ** 30} if torch.cuda.is_available() else {}


def host_memory(device) -> dict:
    """Resident and peak resident host memory, summed over the ranks (a collective; GiB)."""
    local = host_memory_now()
    values = torch.tensor([local["host_rss_gib"], local["host_peak_rss_gib"]], dtype=torch.float64, device=device)
    dist.all_reduce(values)
    return {"host_rss_gib": float(values[0]), "host_peak_rss_gib": float(values[1])}


def offloaded(offload) -> dict:
    """GiB of checkpointed inputs this rank offloaded in its last micro-step (0: no offload)."""
    stats = getattr(offload, "stats", None)
    return {"offloaded_gib": stats.offloaded_bytes / 2 ** 30 if stats is not None else 0.0}


def peak_memory() -> dict:
    """On CUDA, every rank's peak allocated memory so far (GiB; a collective over the world):
    ``peak_memory_gib`` the largest, ``peak_memory_gib_rank<r>`` each rank's. Empty on CPU."""
    if not torch.cuda.is_available():
        return {}
    local = torch.tensor([torch.cuda.max_memory_allocated() / 2 ** 30], device="cuda", dtype=torch.float64)
    everyone = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, local)
    values = [float(t) for t in everyone]
    return {"peak_memory_gib": max(values), **{f"peak_memory_gib_rank{r}": v for r, v in enumerate(values)}}


def main(argv=None):
    rank = launcher_rank()
    quiet_other_ranks(rank)
    quiet_known_warnings()
    args = parse_args(argv)
    watchdog = Watchdog(args.save_dir, rank).start()
    try:
        train(args, watchdog)
        shutdown()  # the estimator's CUDA graphs first: a live one makes the NCCL teardown hang
    except (ConfigError, DataConfigError, ParallelConfigError) as error:
        if rank == 0:  # every rank finds the same problem: one copy
            print(f"ds_mtraining.train: configuration error: {error}", file=sys.stderr)
        sys.exit(2)
    except DeviceError as error:  # only the ranks without a device find it
        print(f"ds_mtraining.train: {error}", file=sys.stderr)
        sys.exit(2)
    except (OutOfMemory, DiskFull) as error:  # one line from the rank that ran out; the launcher stops the rest
        watchdog.stop(str(error), code=1, printer=rank)
    except NonFinite as error:  # every rank finds it in the same step
        watchdog.stop(str(error), code=1, printer=0)
    except Exception as error:  # noqa: BLE001 - a dead peer or launcher: one line, no traceback
        watchdog.on_failure(error)
        raise


if __name__ == "__main__":
    main()
