"""What rank 0 reports: a progress bar or log lines, the run's layout, and where metrics go."""
from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from .run_config import RunConfig


class Progress:
    """Rank 0's view of training: a live rich bar on a terminal, one line per logged step
    otherwise (launcher logs)."""

    def __init__(self, total_steps: int, first_step: int, enabled: bool, console=None):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, \
            TimeRemainingColumn
        self.enabled = enabled
        self.console = console or Console(soft_wrap=True)  # whole lines in launcher logs
        self.live = enabled and self.console.is_terminal
        self.bar = None
        if self.live:
            # every field fits in 120 columns: a short bar, the metrics text kept whole
            self.bar = RichProgress(TextColumn("[bold]train"), BarColumn(bar_width=16), MofNCompleteColumn(),
                                    TextColumn("{task.fields[metrics]}"), TimeRemainingColumn(),
                                    console=self.console)
            self.task = self.bar.add_task("train", total=total_steps, completed=first_step, metrics="")
            self.bar.start()
        self.total_steps = total_steps

    def update(self, step: int, metrics: dict):
        if not self.enabled:
            return
        text = f"loss {metrics['loss']:.4f}  tok/s {metrics['tokens_per_s']:.0f}"
        for name, label, digits in (("density", "density", 3), ("imbalance", "imbalance", 3),
                                    ("peak_memory_gib", "peak GiB", 1)):
            if name in metrics:  # (the Ulysses baseline has no index; CPU runs no GPU memory)
                text += f"  {label} {metrics[name]:.{digits}f}"
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


def describe_run(run: RunConfig, groups) -> str:
    """One line on how the run is laid out (printed by rank 0)."""
    sp, dp = run.sequence_parallel_size, groups.get_data_parallel_world_size()
    if run.attention == "ulysses":
        return (f"DeepSpeed-Ulysses: {dist.get_world_size()} ranks = {dp} data-parallel x {sp} sequence-parallel, "
                f"seq_len {run.seq_len} ({run.seq_len // sp} contiguous tokens per rank), dense attention "
                f"(heads split over the {sp} ranks), documents not masked")
    ring = groups.ring
    if groups.hierarchy is not None:
        ring += f" ({groups.hierarchy.nodes} nodes x {groups.hierarchy.per_node})"
    return (f"MTraining: {dist.get_world_size()} ranks = {dp} data-parallel x {sp} sequence-parallel, "
            f"{ring} ring, seq_len {run.seq_len} ({run.seq_len // sp} tokens per rank, stripe block "
            f"{run.sparse.block_size}), " + _attention_text(run)
            + (", documents masked" if run.document_masking else ", documents not masked"))


def _attention_text(run: RunConfig) -> str:
    if run.attention == "sparse":
        return f"sparse attention, top-p {run.sparse.p_vertical}/{run.sparse.p_slash}"
    from ds_mtraining.static import attention_pattern
    details = attention_pattern(run.attention, run.static).describe(run.seq_len, run.sparse.block_size)
    return f"{run.attention} attention ({details})"


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
