"""What every rank agrees on after each optimizer step, in one small all-reduce over the world:
whether a rank was asked to stop (SIGTERM or SIGUSR1: save this step, then stop; see
:mod:`.watchdog`) and whether a rank's loss was non-finite.

A non-finite loss, or in bf16 and fp32 a step that DeepSpeed skipped for a non-finite gradient
norm (``engine.was_step_applied()``), starts a streak; a streak longer than
``mtraining.max_nonfinite_steps`` stops the run with :class:`NonFinite` (one line: the step, the
ranks, the value). No checkpoint is written during a streak: a save that falls in one is made
at the first finite step after it, and a run that ends in one raises. In fp16 a skipped step is
the loss scaler's normal business, not a streak; a scaler out of scales to try (DeepSpeed raises
at its minimum) stops the run with :class:`NonFinite` too (:func:`loss_scale_exhausted`).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from . import MTRAINING_KEY

VALUES = {1: "nan", 2: "inf", 3: "-inf"}  # a rank's non-finite loss, as the all-reduce carries it
# what DeepSpeed's fp16 DynamicLossScaler raises when the gradients overflow at its minimum scale
AT_MIN_LOSS_SCALE = "Current loss scale already at minimum"


class NonFinite(RuntimeError):
    """The run stops on non-finite values; the message is its one line."""


def loss_scale_exhausted(error: Exception, step: int) -> NonFinite | None:
    """The one line for DeepSpeed's fp16 loss scaler raising at its minimum scale (every rank
    finds the same overflow in the same step); None for another error."""
    if AT_MIN_LOSS_SCALE not in str(error):
        return None
    return NonFinite(f"fp16 gradients overflow at the loss scaler's minimum scale (fp16.min_loss_scale) at step "
                     f"{step}; the run stops without saving it: train in bf16 (\"bf16\": {{\"enabled\": true}} in "
                     f"place of \"fp16\"), or lower the learning rate")


def loss_code(losses: list[torch.Tensor]) -> int:
    """0 when every micro-step's loss is finite, else the first non-finite one's :data:`VALUES` key."""
    for value in torch.stack(losses).tolist():
        if not math.isfinite(value):
            return 1 if math.isnan(value) else 2 if value > 0 else 3
    return 0


class StepChecks:
    """Called by the training loop once per optimizer step (a collective on every rank)."""

    def __init__(self, engine, max_nonfinite_steps: int, last_step: int, watchdog=None):
        self.engine, self.limit, self.last_step, self.watchdog = engine, max_nonfinite_steps, last_step, watchdog
        self.streak, self.first_bad, self.owed = 0, 0, False

    def after_step(self, step: int, losses: list[torch.Tensor]) -> int:
        """The signal that asked for a stop on some rank (0: none); raises :class:`NonFinite`."""
        world, rank = dist.get_world_size(), dist.get_rank()
        flags = torch.zeros(2, world, dtype=torch.int64, device=self.engine.device)
        flags[0, rank] = self.watchdog.preempt if self.watchdog is not None else 0
        flags[1, rank] = loss_code(losses)
        dist.all_reduce(flags)
        signals, codes = flags.tolist()
        bad = {r: VALUES[c] for r, c in enumerate(codes) if c}
        skipped = not self.engine.fp16_enabled() and not self.engine.was_step_applied()
        if not bad and not skipped:
            self.streak = 0
            return max(signals)
        self.streak += 1
        self.first_bad = self.first_bad if self.streak > 1 else step
        if self.streak > self.limit or step == self.last_step:
            raise NonFinite(self._line(step, bad, skipped))
        return max(signals)

    def save_due(self, due: bool) -> bool:
        """Whether to save now: ``due`` (or an earlier save owed), and not inside a streak."""
        self.owed = self.owed or due
        if self.owed and self.streak == 0:
            self.owed = False
            return True
        return False

    def _line(self, step: int, bad: dict, skipped: bool) -> str:
        if bad:
            values = sorted(set(bad.values()))
            what = f"non-finite loss ({'/'.join(values)} on rank{'s' * (len(bad) > 1)} " \
                   f"{', '.join(map(str, bad))})"
        else:
            what = f"non-finite gradient norm ({self.engine.get_global_grad_norm()}: DeepSpeed skipped the step)"
        streak = (f", {self.streak} steps in a row from step {self.first_bad} ({MTRAINING_KEY}.max_nonfinite_steps="
                  f"{self.limit})" if self.streak > 1 else "")
        return (f"{what} at step {step}{streak}; the run stops without saving it (no checkpoint after step "
                f"{self.first_bad - 1}): lower the learning rate, or resume from before it with other settings")
