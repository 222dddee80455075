"""The trainer's rule on resume: this run's config wins over the checkpoint's hyperparameters.

A container's `load_state_dict` restores the hyperparameters a state dict holds, as torch's
optimizers do (a torchft replica group healing from a live peer must take the peer's). A
trainer resuming its own checkpoint, or seeding from another run, means to train on with the
config it was started with: `ConfigSettings` keeps the groups' settings as the container was
built from the config, and puts them back after such a load, saying in one line what changed.
The lr of a group under an LR scheduler is the scheduler's to set (from its base lr, which
`initial_lr` holds, and its position); the base lr is put back.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from containers import OptimizersContainer
from containers.state.flat import setting_changes

__all__ = ["ConfigSettings"]

logger = logging.getLogger(__name__)


class ConfigSettings:
    """Every param group's settings of `optimizers` as they are now (built from the config).

    Args:
        optimizers: the container, after its LR schedulers were built on it.
    """

    def __init__(self, optimizers: OptimizersContainer) -> None:
        self.optimizers = optimizers
        self.groups = [_settings(g) for g in optimizers.param_groups]

    def restore(self) -> list[str]:
        """Set the config's settings back on the groups (after a load); log and return what
        the load had changed."""
        changes = setting_changes(list(self.optimizers), self.groups)
        for group, settings in zip(self.optimizers.param_groups, self.groups, strict=True):
            for key, value in settings.items():
                if key == "lr" and "initial_lr" in settings:
                    continue  # the scheduler's, from the base lr put back here
                group[key] = _copy(value)
        if changes:
            logger.info("resume: from the config, not the checkpoint: %s", ", ".join(changes))
        return changes


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    return {k: _copy(v) for k, v in group.items() if k != "params"}


def _copy(value: Any) -> Any:
    """A tensor setting (a tensor lr) copied, so later writes to the group do not reach it."""
    return value.clone() if isinstance(value, torch.Tensor) else value
