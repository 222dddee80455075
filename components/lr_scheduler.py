"""LR schedules for an optimizer container: linear warmup, then constant, then a decay (WSD).

The saved state is the step alone. Base lrs come from the groups when the schedulers are
built (that is, from this run's config), so a checkpoint resumes at the same point of the
schedule, whatever the number of inner optimizers, and an lr changed in the config takes effect.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.lr_scheduler import LambdaLR

from config import LRScheduler as LRSchedulerConfig
from containers import OptimizersContainer

__all__ = ["LRSchedulersContainer", "build_lr_schedulers", "lr_factor"]


def lr_factor(step: int, cfg: LRSchedulerConfig, total_steps: int) -> float:
    """Multiplier of the base lr for the optimizer step that follows `step` finished steps."""
    warmup = min(cfg.warmup_steps, total_steps)
    if step < warmup:
        # Starts above zero so the first step already learns: (step + 1) / (warmup + 1).
        return (step + 1) / (warmup + 1)
    after = total_steps - warmup
    decay_steps = after if cfg.decay_ratio is None else round(after * cfg.decay_ratio)
    decay_start = total_steps - decay_steps
    if step < decay_start or decay_steps == 0:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    if cfg.decay_type == "linear":
        shape = 1.0 - progress
    elif cfg.decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * shape


class LRSchedulersContainer(Stateful):
    """One `LambdaLR` per inner optimizer of a container, all on the same schedule.

    Args:
        optimizers: the container whose groups' current lrs are the base lrs.
        cfg: the `[lr_scheduler]` section.
        total_steps: training steps the schedule spans (`[training] steps`).
    """

    def __init__(
        self, optimizers: OptimizersContainer, cfg: LRSchedulerConfig, total_steps: int
    ) -> None:
        self.factor = functools.partial(lr_factor, cfg=cfg, total_steps=total_steps)
        self.schedulers = [LambdaLR(opt, self.factor) for opt in optimizers]
        for scheduler in self.schedulers:
            # Our containers keep their own lrs on a load, but an optimizer of another make
            # brings back the checkpoint's, after DCP loaded "lr_scheduler" (key order):
            # re-apply this run's schedule, so the first resumed step uses this run's lr.
            scheduler.optimizer.register_load_state_dict_post_hook(
                lambda _optimizer, s=scheduler: self._apply_schedule(s)
            )

    def __iter__(self) -> Iterator[LambdaLR]:
        return iter(self.schedulers)

    def __len__(self) -> int:
        return len(self.schedulers)

    @property
    def last_step(self) -> int:
        return self.schedulers[0].last_epoch

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def get_last_lr(self) -> float:
        """The lr the next optimizer step of the first group uses, for logging."""
        # The group itself, not LambdaLR's cached copy: a load sets the groups' lrs.
        return self.schedulers[0].optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.last_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        step = int(state_dict["step"])
        if step < 0:
            raise ValueError(f"lr scheduler checkpoint has step = {step}; expected >= 0")
        for scheduler in self.schedulers:
            scheduler.last_epoch = step
            self._apply_schedule(scheduler)

    def _apply_schedule(self, scheduler: LambdaLR) -> None:
        """Set the groups' lrs to this run's base lrs at the scheduler's current step."""
        factor = self.factor(scheduler.last_epoch)
        for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True):
            group["lr"] = base * factor


def build_lr_schedulers(
    optimizers: OptimizersContainer, cfg: LRSchedulerConfig, total_steps: int
) -> LRSchedulersContainer:
    return LRSchedulersContainer(optimizers, cfg, total_steps)
