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
        "host_reserve_gib": "auto",     # host memory the check leaves free: auto = min(6, a twentieth)
        "expandable_segments": true     # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless set
                                        # (pinned blocks at their size: memory.exact_pinning)
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
import os
import sys
import time
from dataclasses import dataclass, field
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
from ds_mtraining.record import write_json
from ds_mtraining.step import new_step
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
from ds_mtraining.training.step_checks import NonFinite, StepChecks, loss_scale_exhausted
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


@dataclass
class TrainingRun:
    """What the loop reads and advances: built once (:func:`build`), then one step at a time."""

    args: argparse.Namespace
    run: RunConfig
    ds_config: dict
    plan: object  # training.memory's plan (memory settings, offloaded layers)
    groups: object  # ParallelGroups (DeepSpeed's mpu)
    model: torch.nn.Module  # the transformers model (what --export_hf writes)
    engine: object  # the DeepSpeed engine around MTrainingCausalLM
    batches: RankBatches
    stats: object  # layer.AttentionStats (off: ulysses)
    watchdog: Watchdog | None = None
    step: int = 0  # optimizer steps done
    position: int = 0  # micro-batches read, over the whole run
    history: list = field(default_factory=list)  # each step's mean loss
    checks: StepChecks | None = None
    progress: Progress | None = None
    offload: object = None  # CheckpointOffload, or a null context

    def at(self, phase: str):
        """A progress mark (the watchdog's stall detection names the phase a stalled rank was in)."""
        if self.watchdog is not None:
            self.watchdog.at(phase)

    @property
    def ulysses(self) -> bool:
        return self.run.attention == ULYSSES

    @property
    def tokens_per_step(self) -> int:
        return (self.engine.train_micro_batch_size_per_gpu() * self.engine.gradient_accumulation_steps()
                * self.groups.get_data_parallel_world_size() * self.run.seq_len)


def train(args, watchdog: Watchdog | None = None) -> dict:
    """``args.steps`` optimizer steps: :func:`build`, then per step :func:`run_step`, the step
    checks, :func:`report_step` and :func:`save_step`; at the end :func:`finish`. Returns the
    losses, the last step and the model (for in-process callers, tests)."""
    t = build(args, watchdog)
    while t.step < args.steps:
        started = time.perf_counter()
        losses, profiler, resident = run_step(t)
        t.step += 1
        t.at("end of step")
        report_profile(t, profiler, started)
        preempt = t.checks.after_step(t.step, losses)  # a signal on any rank; raises NonFinite
        report_step(t, losses, started, resident)
        save_step(t, preempt)
    finish(t)
    return {"losses": t.history, "step": t.step, "model": t.model}


def build(args, watchdog: Watchdog | None = None) -> TrainingRun:
    """Everything before step 1, cheapest failures first: the config, memory plan and data before
    any process group (:func:`load_inputs`), the ranks (:func:`start_ranks`), the model
    (:func:`build_module`), the engine (:func:`start_engine`), the starting step (:func:`start_loop`)."""
    startup = StartupClock()  # where a long start-up goes (a 3B model: minutes)
    run, ds_config, plan, samples = load_inputs(args)
    groups, dense = start_ranks(run, watchdog)
    startup.done("config, data, process groups and ops")
    if watchdog is not None:
        watchdog.at("building the model")
    model, module, stats = build_module(run, args.seed, plan, groups, dense, startup)
    if watchdog is not None:
        watchdog.at("starting the engine")
    engine, batches = start_engine(module, run, ds_config, groups, samples, args.seed, dense, startup)
    t = TrainingRun(args, run, ds_config, plan, groups, model, engine, batches, stats, watchdog)
    start_loop(t, startup)
    return t


def load_inputs(args) -> tuple:
    """(run config, DeepSpeed config, memory plan, this rank's samples), with the save folder
    claimed: all before any process group, so that a bad value, a refused folder, a host that
    cannot hold the run or an empty or unreadable corpus is one line, not a hang."""
    datasets_offline()
    world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    run, ds_config = load_run_config(args.deepspeed_config, world_size, args.model, args.data)
    ds_config = with_default_monitor(ds_config, args.save_dir)
    claim_save_dir(args.save_dir, monitor_dir(ds_config), args.resume, args.overwrite, clear=local_rank() == 0)
    # before CUDA starts (the allocator setting) and before the optimizer takes host memory
    plan = plan_memory(run, ds_config, world_size)
    if launcher_rank() == 0:
        print(plan.describe(), flush=True)
    tokenizer = load_tokenizer(run.tokenizer)
    samples = training_samples(run.data, run.seq_len, tokenizer, args.seed, model_config(run.model).vocab_size,
                               key=f"{MTRAINING_KEY}.data")
    return run, ds_config, plan, samples


def start_ranks(run: RunConfig, watchdog: Watchdog | None) -> tuple:
    """This rank's device, torch.distributed and the parallel groups (every group with the stall
    timeout), the attention op loaded; returns (groups, the dense baselines' backend or None)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
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
    return groups, dense


def build_module(run: RunConfig, seed: int, plan, groups, dense, startup: StartupClock) -> tuple:
    """(the model, seeded; the loss module DeepSpeed trains around it; its attention statistics):
    liger's kernels where on, the tiled MLP, MTraining's attention (the Ulysses baseline is
    registered by :func:`start_engine`, once the micro-batch size is known), checkpointing."""
    from deepspeed.accelerator import get_accelerator
    from ds_mtraining.hf import use_mtraining_attention
    from ds_mtraining.layer import AttentionStats, MTrainingAttentionSettings
    from ds_mtraining.static import attention_pattern
    torch.manual_seed(seed)
    model = build_model(run.model, random_init_device(run.model, get_accelerator().current_device_name()))
    startup.done("model")
    fused_off = use_fused_kernels(model, run.liger)
    if launcher_rank() == 0:
        print("ds_mtraining: liger-kernel RMSNorm/RoPE/SwiGLU and fused linear cross-entropy: "
              + (f"off ({fused_off})" if fused_off else "on"))
    if plan.tiled_mlp:  # after liger: the tiles wrap liger's SwiGLU where it was applied
        tile_mlps(model, plan.mlp_chunk_tokens)
    stats = AttentionStats(enabled=False)
    if run.attention != ULYSSES:
        pattern = attention_pattern(run.attention, run.static)  # None (sparse) or a fixed baseline
        use_mtraining_attention(model, MTrainingAttentionSettings.from_groups(
            run.sparse, groups, stats, pattern, run.keep_attention_output, dense.name if dense else "sdpa"))
    if run.gradient_checkpointing:
        enable_checkpointing(model)
    module = MTrainingCausalLM(model, groups.sequence_group, run.loss_chunk_tokens,
                               fused_loss=fused_off is None).train()
    return model, module, stats


def start_engine(module, run: RunConfig, ds_config: dict, groups, samples, seed: int, dense,
                 startup: StartupClock) -> tuple:
    """(the DeepSpeed engine, this rank's micro-batches); under ``ulysses`` the model's dense
    attention registered with DeepSpeed-Ulysses for the engine's micro-batch size."""
    import deepspeed
    from ds_mtraining.hf import use_ulysses_attention
    engine, _, _, _ = deepspeed.initialize(model=module, config=ds_config, mpu=groups,
                                           model_parameters=[p for p in module.parameters() if p.requires_grad])
    startup.done("DeepSpeed engine")
    if engine.device.type == "cuda":  # the fp32 weights of a random init on the GPU, now cast: not kept cached
        torch.cuda.empty_cache()
    micro_batch = engine.train_micro_batch_size_per_gpu()
    ulysses = run.attention == ULYSSES
    if ulysses:
        use_ulysses_attention(module.model, groups.sequence_ranks, micro_batch, run.seq_len, dense.name)
    batches = RankBatches(samples, micro_batch, groups.get_data_parallel_rank(),
                          groups.get_data_parallel_world_size(), groups.get_sequence_parallel_rank(),
                          run.sequence_parallel_size, run.sparse.block_size, seed, run.document_masking,
                          "contiguous" if ulysses else "striped")
    return engine, batches


def start_loop(t: TrainingRun, startup: StartupClock):
    """The starting step (0, or the latest checkpoint's with ``--resume``), the step checks, the
    watchdog's step, the progress display, rank 0's start-up files, the checkpoint offload."""
    args, engine = t.args, t.engine
    if args.resume:
        t.at("loading the checkpoint")
        t.step, t.position = resume_checkpoint(engine, args.save_dir, t.run)
        continue_metrics(engine, args.save_dir, t.step)  # no second header, no step logged twice
    t.checks = StepChecks(engine, t.run.max_nonfinite_steps, args.steps, t.watchdog)
    if t.watchdog is not None:
        t.watchdog.step = t.step
        t.watchdog.preemptible = not args.no_checkpoint  # SIGTERM/SIGUSR1: save the step in flight, then stop
    t.progress = Progress(args.steps, t.step, enabled=dist.get_rank() == 0 and not args.no_progress)
    if dist.get_rank() == 0:
        write_json(Path(args.save_dir) / "memory_plan.json", t.plan.to_dict())
        write_json(Path(args.save_dir) / "startup.json", startup.seconds)
        record_files(args.save_dir, ["memory_plan.json", "startup.json"])
    t.offload = (CheckpointOffload(t.plan.offload_layers, t.plan.num_layers, engine.device.type == "cuda")
                 if t.plan.offload_layers else contextlib.nullcontext())
    t.progress.print(describe_run(t.run, t.groups) + f"; {startup.describe()}")
    if args.resume:
        t.progress.print(f"resumed from {args.save_dir} at step {t.step} (data position {t.position})")


def run_step(t: TrainingRun) -> tuple:
    """Step ``t.step + 1``: a new step for the once-per-step checks (:func:`ds_mtraining.step.new_step`),
    the statistics reset (recorded in a logged step's first micro-batch), then :func:`train_step`,
    profiled at ``--profile_step``; a CUDA out-of-memory error becomes one line (:class:`OutOfMemory`),
    and so does an fp16 loss scaler out of scales (:class:`NonFinite`).
    Returns (the micro-batches' losses, the profiler or None, the memory resident before the step)."""
    new_step()
    t.stats.reset()
    t.stats.enabled = (t.step + 1) % t.args.log_interval == 0
    resident = resident_memory()
    try:
        with profiled(t.args.profile_step == t.step + 1) as profiler:
            losses, t.position = train_step(t.engine, t.batches, t.position, t.engine.gradient_accumulation_steps(),
                                            t.stats, t.offload, t.at)
    except torch.OutOfMemoryError as error:
        raise OutOfMemory(out_of_memory_line(error, t.run, t.plan, t.step + 1)) from None
    except Exception as error:  # noqa: BLE001 - DeepSpeed's fp16 scaler raises a bare Exception
        raise loss_scale_exhausted(error, t.step + 1) or error
    return losses, profiler, resident


def train_step(engine, batches, position: int, accumulation: int = 1, stats=None, offload=None,
               at=lambda phase: None) -> tuple[list, int]:
    """One optimizer step: ``accumulation`` micro-batches of ``batches`` (``batch(position)``) from
    ``position`` on, each forward (``engine(**batch)``: the loss), ``engine.backward`` and
    ``engine.step()`` (DeepSpeed's engine updates the weights at the last micro-batch); ``stats``
    (attention statistics) stop recording after the first micro-batch; ``offload`` is entered
    around each forward and backward. Returns (each micro-batch's loss, detached float32; the next
    position)."""
    offload = offload if offload is not None else contextlib.nullcontext()
    losses = []
    for _ in range(accumulation):
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
        if stats is not None:
            stats.enabled = False
    return losses, position


def report_profile(t: TrainingRun, profiler, started: float):
    """A profiled step's summary by kind of work: written, printed, and listed among the run's files."""
    if profiler is None:
        return
    summary = summarise(profiler, t.step, dist.get_rank(), time.perf_counter() - started)
    write_summary(summary, t.args.save_dir)
    t.progress.print(describe(summary))
    if dist.get_rank() == 0:  # every rank's file, among the run's
        ranks = range(dist.get_world_size())
        record_files(t.args.save_dir, [profile_path(t.args.save_dir, t.step, r) for r in ranks])


def report_step(t: TrainingRun, losses: list, started: float, resident: dict):
    """The step's mean loss over the data-parallel replicas (into ``t.history``); every
    ``--log_interval`` steps the metrics, to DeepSpeed's monitor, the metrics files and the display."""
    mean_loss = torch.stack(losses).mean()
    dist.all_reduce(mean_loss, group=t.groups.data_group)
    mean_loss = float(mean_loss) / t.groups.get_data_parallel_world_size()
    elapsed = time.perf_counter() - started
    t.history.append(mean_loss)
    if t.step % t.args.log_interval != 0:
        return
    engine = t.engine
    metrics = {"loss": mean_loss, "tokens_per_s": t.tokens_per_step / elapsed,
               "lr": engine.get_lr()[0], **({} if t.ulysses else t.stats.summary()), **peak_memory(),
               **resident, **host_memory(engine.device), **offloaded(t.offload)}
    engine.monitor.write_events([(f"Train/mtraining/{k}", v, t.step) for k, v in metrics.items()])
    record_metrics(engine, t.args.save_dir)
    t.progress.update(t.step, metrics)


def save_step(t: TrainingRun, preempt):
    """The checkpoint when due (every ``--save_interval`` steps, at the last step, on preemption;
    never with ``--no_checkpoint``, nor where the step checks refuse it); a preempted run stops
    here once its step is saved."""
    args = t.args
    due = args.save_interval and t.step % args.save_interval == 0 or t.step == args.steps or preempt
    seconds = None
    if not args.no_checkpoint and t.checks.save_due(bool(due)):
        t.at("checkpoint save")
        seconds = save_checkpoint(t.engine, args.save_dir, t.step, t.position, t.run)
    if t.watchdog is not None:
        t.watchdog.step = t.step
    if preempt:
        t.watchdog.preempted(preempt, seconds)


def finish(t: TrainingRun):
    """After the last step: the HF export (``--export_hf``), then where the checkpoint, the
    metrics and the export are, and what to run next."""
    args, step = t.args, t.step
    if t.watchdog is not None:
        t.watchdog.preemptible = False
    t.progress.close()
    if args.export_hf:
        t.at("export")
        tokenizer_dir = None if t.run.tokenizer == "bytes" else t.run.tokenizer
        exported = export_hf(t.model, args.export_hf, tokenizer_dir)
        t.progress.print(f"exported:   {exported} (step {step}; AutoModelForCausalLM.from_pretrained)")
    if not args.no_checkpoint:
        t.progress.print(f"checkpoint: {Path(args.save_dir).resolve()} (tag step{step})")
    where = monitor_dir(t.ds_config)
    if where:
        t.progress.print(f"metrics:    {Path(where).resolve()}")
    if args.export_hf:  # the export is the step after the checkpoint: what comes next is its evaluation
        t.progress.print(f"next:       evaluate it: python -m ds_mtraining.eval {args.export_hf}"
                         + (f"; more steps: --resume --steps {2 * step}" if not args.no_checkpoint else ""))
    elif not args.no_checkpoint:
        t.progress.print(f"next:       more steps: --resume --steps {2 * step}; a Hugging Face model: --resume "
                         f"--steps {step} --export_hf DIR, then python -m ds_mtraining.eval DIR")


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
