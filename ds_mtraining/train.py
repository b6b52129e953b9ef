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
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ds_mtraining.config import SparseConfig
from ds_mtraining.data import (DataConfigError, RankBatches, PackedSequences, check_data_spec,
                               datasets_offline, load_documents, load_tokenizer, tokenize_documents)
from ds_mtraining.distributed import (RING_KINDS, ParallelConfigError, check_parallel_sizes,
                                      initialize_groups)

MTRAINING_KEY = "mtraining"
PRESETS = {
    # the Qwen2 shape at toy size: GQA 2:1, RoPE theta 1e6, untied head; byte vocabulary
    "tiny-qwen2": {"model_type": "qwen2", "vocab_size": 257, "hidden_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                   "rope_theta": 1e6, "max_position_embeddings": 1 << 20, "tie_word_embeddings": False},
}


class ConfigError(ValueError):
    """An MTraining setting that cannot work; the message names the key and the fix."""


@dataclass
class RunConfig:
    """The validated ``mtraining`` section (see the module docstring)."""

    seq_len: int
    sequence_parallel_size: int
    ring: str
    sparse: SparseConfig
    model: dict
    tokenizer: str = "bytes"
    data: dict = field(default_factory=lambda: {"source": "stdlib"})
    loss_chunk_tokens: int = 1024
    gradient_checkpointing: bool = False

    def to_dict(self) -> dict:
        values = asdict(self)
        values["sparse"] = self.sparse.to_dict()
        return values


# ----------------------------------------------------------------------------- config
def _positive_int(section: dict, key: str, default=None) -> int:
    value = section.get(key, default)
    if value is None:
        raise ConfigError(f"{MTRAINING_KEY}.{key} is required (a positive integer)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{MTRAINING_KEY}.{key}={value!r} must be a positive integer")
    return value


def _model_spec(value) -> dict:
    spec = {"name_or_path": value} if isinstance(value, str) else dict(value or {})
    unknown = sorted(set(spec) - {"name_or_path", "config_overrides"})
    if unknown or "name_or_path" not in spec:
        raise ConfigError(f"{MTRAINING_KEY}.model must be a preset name {sorted(PRESETS)}, a local model "
                          f"directory, or {{'name_or_path': ..., 'config_overrides': {{...}}}}; got {value!r}")
    name = spec["name_or_path"]
    if name not in PRESETS and not Path(name).is_dir():
        raise ConfigError(f"{MTRAINING_KEY}.model={name!r} is neither a preset {sorted(PRESETS)} nor an "
                          f"existing local directory (config.json [+ weights]); models are never downloaded: "
                          f"pass a preset or a local path (--model)")
    return {"name_or_path": name, "config_overrides": dict(spec.get("config_overrides", {}))}


def model_config(spec: dict):
    """The transformers config of a model spec (preset or local directory) with its overrides."""
    from transformers import AutoConfig, CONFIG_MAPPING
    name = spec["name_or_path"]
    if name in PRESETS:
        values = dict(PRESETS[name])
        config = CONFIG_MAPPING[values.pop("model_type")](**values)
    else:
        config = AutoConfig.from_pretrained(name, local_files_only=True)
    for key, value in spec["config_overrides"].items():
        if not hasattr(config, key):
            raise ConfigError(f"{MTRAINING_KEY}.model.config_overrides.{key}: {type(config).__name__} "
                              f"has no such field")
        setattr(config, key, value)
    return config


def check_model(spec: dict, vocab_size: int):
    """Heads/GQA/feature checks and the tokenizer's vocabulary against the model's."""
    from ds_mtraining.hf import check_model_config
    config = model_config(spec)
    try:
        check_model_config(config, key=f"{MTRAINING_KEY}.model ({spec['name_or_path']})")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if vocab_size > config.vocab_size:
        raise ConfigError(f"{MTRAINING_KEY}.tokenizer has {vocab_size} tokens but the model's vocab_size is "
                          f"{config.vocab_size}; use a matching tokenizer or override vocab_size")
    return config


def parse_run_config(section: dict, world_size: int) -> RunConfig:
    """Validates the ``mtraining`` section against a world of ``world_size`` ranks."""
    if not isinstance(section, dict):
        raise ConfigError(f"the DeepSpeed JSON needs a \"{MTRAINING_KEY}\" object, got {section!r}")
    known = {"seq_len", "sequence_parallel_size", "ring", "stripe_block", "sparse", "model", "tokenizer",
             "data", "loss_chunk_tokens", "gradient_checkpointing"}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in '{MTRAINING_KEY}'; valid keys are {sorted(known)}")
    sp = section.get("sequence_parallel_size", world_size)
    try:
        check_parallel_sizes(world_size, sp, key=f"{MTRAINING_KEY}.sequence_parallel_size")
    except ParallelConfigError as error:
        raise ConfigError(str(error)) from None
    ring = section.get("ring", "auto")
    if ring not in RING_KINDS:
        raise ConfigError(f"{MTRAINING_KEY}.ring={ring!r} is not a ring kind; use one of {list(RING_KINDS)}")
    sparse_values = dict(section.get("sparse", {}))
    if "stripe_block" in section:
        block = section["stripe_block"]
        if "block_size" in sparse_values and sparse_values["block_size"] != block:
            raise ConfigError(f"{MTRAINING_KEY}.stripe_block={block} differs from {MTRAINING_KEY}.sparse."
                              f"block_size={sparse_values['block_size']}; the stripe is the kernel block: "
                              f"give one of them")
        sparse_values["block_size"] = block
    try:
        sparse = SparseConfig.from_dict(sparse_values, where=f"{MTRAINING_KEY}.sparse")
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{MTRAINING_KEY}.sparse: {error}") from None
    seq_len = _positive_int(section, "seq_len")
    unit = sparse.block_size * sp
    if seq_len % unit != 0:
        lower, upper = seq_len // unit * unit, (seq_len // unit + 1) * unit
        raise ConfigError(
            f"{MTRAINING_KEY}.seq_len={seq_len} is not divisible by stripe_block x sequence_parallel_size = "
            f"{sparse.block_size} x {sp} = {unit}; use a multiple of {unit} (e.g. {lower or upper} or {upper})")
    checkpointing = section.get("gradient_checkpointing", False)
    if not isinstance(checkpointing, bool):
        raise ConfigError(f"{MTRAINING_KEY}.gradient_checkpointing={checkpointing!r} must be true or false")
    model = _model_spec(section.get("model", "tiny-qwen2"))
    tokenizer = section.get("tokenizer", "bytes")
    if tokenizer == "model":
        if model["name_or_path"] in PRESETS:
            raise ConfigError(f"{MTRAINING_KEY}.tokenizer='model' needs a model directory, but the model is "
                              f"the preset {model['name_or_path']!r}; use tokenizer 'bytes'")
        tokenizer = model["name_or_path"]
    return RunConfig(seq_len=seq_len, sequence_parallel_size=sp, ring=ring, sparse=sparse, model=model,
                     tokenizer=tokenizer, data=dict(section.get("data", {"source": "stdlib"})),
                     loss_chunk_tokens=_positive_int(section, "loss_chunk_tokens", 1024),
                     gradient_checkpointing=checkpointing)


def _data_override(value: str) -> dict:
    """``--data``: "stdlib", a saved dataset directory, or comma-separated local files."""
    if value == "stdlib":
        return {"source": "stdlib"}
    if Path(value).is_dir():
        return {"saved_dataset": value}
    return {"files": value.split(",")}


def load_run_config(ds_config: str | dict, world_size: int, model: str | None = None,
                    data: str | None = None) -> tuple[RunConfig, dict]:
    """Reads a DeepSpeed JSON (path or dict), validates its ``mtraining`` section (with the
    ``--model``/``--data`` overrides) and returns it with the rest for DeepSpeed."""
    if isinstance(ds_config, dict):
        values = json.loads(json.dumps(ds_config))
    else:
        if not Path(ds_config).is_file():
            raise ConfigError(f"--deepspeed_config {ds_config!r} does not exist; pass a JSON file "
                              f"(see ds_configs/)")
        try:
            values = json.loads(Path(ds_config).read_text())
        except json.JSONDecodeError as error:
            raise ConfigError(f"--deepspeed_config {ds_config}: invalid JSON ({error})") from None
    section = values.pop(MTRAINING_KEY, None)
    if section is None:
        raise ConfigError(f"the DeepSpeed JSON has no \"{MTRAINING_KEY}\" section; add one with at least "
                          f"\"seq_len\" (see ds_configs/cpu_demo.json)")
    section = dict(section)
    if model is not None:
        section["model"] = model
    if data is not None:
        section["data"] = _data_override(data)
    run = parse_run_config(section, world_size)
    try:
        check_data_spec(run.data, key=f"{MTRAINING_KEY}.data")
        tokenizer = load_tokenizer(run.tokenizer, key=f"{MTRAINING_KEY}.tokenizer")
    except DataConfigError as error:
        raise ConfigError(str(error)) from None
    check_model(run.model, tokenizer.vocab_size)
    return run, values


# ----------------------------------------------------------------------------- model
class MTrainingCausalLM(torch.nn.Module):
    """A transformers causal LM whose loss is the chunked sequence-parallel cross-entropy:
    ``forward(input_ids, labels, position_ids)`` on this rank's striped shard returns the loss."""

    def __init__(self, model, group, loss_chunk_tokens: int):
        super().__init__()
        self.model = model
        self.group = group
        self.loss_chunk_tokens = loss_chunk_tokens

    def forward(self, input_ids, labels, position_ids):
        from ds_mtraining.loss import sequence_parallel_cross_entropy
        hidden = self.model.base_model(input_ids=input_ids, position_ids=position_ids).last_hidden_state
        weight = self.model.get_output_embeddings().weight
        return sequence_parallel_cross_entropy(hidden, weight, labels, self.group, self.loss_chunk_tokens)


def build_model(spec: dict):
    """A transformers causal LM: a preset or config-only directory is built from its config
    (random init, seeded by the caller); a directory with weights is loaded (local files only)."""
    from transformers import AutoModelForCausalLM
    config = model_config(spec)
    path = Path(spec["name_or_path"])
    has_weights = path.is_dir() and (any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin")))
    if has_weights:
        return AutoModelForCausalLM.from_pretrained(path, config=config, local_files_only=True,
                                                    dtype=torch.float32)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


# ----------------------------------------------------------------------------- progress
class Progress:
    """Rank 0's view of training: a live rich bar on a terminal, one line per logged step
    otherwise (launcher logs)."""

    def __init__(self, total_steps: int, first_step: int, enabled: bool):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, \
            TimeRemainingColumn
        self.enabled = enabled
        self.console = Console(soft_wrap=True)  # whole lines in launcher logs
        self.live = enabled and self.console.is_terminal
        self.bar = None
        if self.live:
            self.bar = RichProgress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[metrics]}"), TimeRemainingColumn(),
                                    console=self.console)
            self.task = self.bar.add_task("train", total=total_steps, completed=first_step, metrics="")
            self.bar.start()
        self.total_steps = total_steps

    def update(self, step: int, metrics: dict):
        if not self.enabled:
            return
        text = (f"loss {metrics['loss']:.4f}  tok/s {metrics['tokens_per_s']:.0f}  "
                f"density {metrics['density']:.3f}  imbalance {metrics['imbalance']:.3f}")
        if self.live:
            self.bar.update(self.task, completed=step, metrics=text)
        else:
            self.console.print(f"step {step}/{self.total_steps}  {text}", highlight=False)

    def print(self, message: str):
        if self.enabled:
            self.console.print(message, highlight=False)

    def close(self):
        if self.live:
            self.bar.stop()


# ----------------------------------------------------------------------------- checkpoints
def rng_states() -> dict:
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict):
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_checkpoint(engine, save_dir: str, step: int, data_position: int, run: RunConfig):
    """``engine.save_checkpoint`` with the data position and every rank's RNG states."""
    import torch.distributed as dist
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rng_states())
    client_state = {"step": step, "data_position": data_position, "rng_states": gathered,
                    "mtraining": run.to_dict()}
    engine.save_checkpoint(save_dir, tag=f"step{step}", client_state=client_state)


def resume_checkpoint(engine, save_dir: str, run: RunConfig) -> tuple[int, int]:
    """Loads the latest checkpoint of ``save_dir``; returns (step, data position)."""
    import torch.distributed as dist
    path, client_state = engine.load_checkpoint(save_dir)
    if path is None:
        raise ConfigError(f"--resume: no checkpoint in --save_dir {save_dir} (no 'latest' file); "
                          f"train without --resume first or point --save_dir at a run")
    saved = client_state["mtraining"]
    for key in ("seq_len", "sequence_parallel_size"):
        if saved[key] != getattr(run, key):
            raise ConfigError(f"--resume: the checkpoint was trained with {MTRAINING_KEY}.{key}={saved[key]}, "
                              f"this run has {getattr(run, key)}; resume with the same value")
    states = client_state["rng_states"]
    if len(states) != dist.get_world_size():
        raise ConfigError(f"--resume: the checkpoint has {len(states)} ranks, this run {dist.get_world_size()}; "
                          f"resume with the same number of ranks")
    set_rng_states(states[dist.get_rank()])
    return client_state["step"], client_state["data_position"]


# ----------------------------------------------------------------------------- main
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


def with_default_monitor(ds_config: dict, save_dir: str) -> dict:
    """Enables DeepSpeed's csv monitor under ``save_dir/metrics`` unless the JSON has a monitor
    section (enabled or explicitly disabled)."""
    monitors = ("csv_monitor", "tensorboard", "wandb", "comet")
    if not any(name in ds_config for name in monitors):
        ds_config["csv_monitor"] = {"enabled": True, "output_path": str(Path(save_dir) / "metrics"),
                                    "job_name": "mtraining"}
    return ds_config


def monitor_dir(ds_config: dict) -> str | None:
    for name in ("csv_monitor", "tensorboard"):
        section = ds_config.get(name, {})
        if section.get("enabled"):
            return str(Path(section.get("output_path", "")) / section.get("job_name", "DeepSpeedJobName"))
    return None


def describe_run(run: RunConfig, groups) -> str:
    """One line on how the run is laid out (printed by rank 0)."""
    import torch.distributed as dist
    sp, dp = run.sequence_parallel_size, groups.get_data_parallel_world_size()
    ring = groups.ring
    if groups.hierarchy is not None:
        ring += f" ({groups.hierarchy.nodes} nodes x {groups.hierarchy.per_node})"
    return (f"MTraining: {dist.get_world_size()} ranks = {dp} data-parallel x {sp} sequence-parallel, "
            f"{ring} ring, seq_len {run.seq_len} ({run.seq_len // sp} tokens per rank, stripe block "
            f"{run.sparse.block_size}), top-p {run.sparse.p_vertical}/{run.sparse.p_slash}")


def train(args) -> dict:
    import deepspeed
    import torch.distributed as dist
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
