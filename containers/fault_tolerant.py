"""`FTOptimizersContainer`: the default container driven by a torchft `Manager`.

`zero_grad()` starts the quorum; `step()` asks the manager whether this step commits and runs
the inner optimizers (and the step hooks, once) only if it does. `last_step_committed` tells
the trainer whether to advance its LR schedules and step counter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch.nn as nn
from torch.optim import Optimizer

from containers.base import OptimizersContainer, ParamGroupRule

if TYPE_CHECKING:
    from torchft import Manager

__all__ = ["FTOptimizersContainer"]


class FTOptimizersContainer(OptimizersContainer):
    """Commit-or-skip optimizer steps under torchft.

    Args:
        model_parts: modules whose trainable parameters are optimized.
        optimizer_cls: optimizer for parameters no rule assigns to another class.
        optimizer_kwargs: constructor kwargs of `optimizer_cls`.
        ft_manager: the replica group's `torchft.Manager`.
        param_groups: rules that form param groups by FQN.
    """

    def __init__(
        self,
        model_parts: Sequence[nn.Module],
        optimizer_cls: type[Optimizer],
        optimizer_kwargs: Mapping[str, Any],
        *,
        ft_manager: Manager,
        param_groups: Sequence[ParamGroupRule] = (),
    ) -> None:
        super().__init__(model_parts, optimizer_cls, optimizer_kwargs, param_groups=param_groups)
        self.ft_manager = ft_manager

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start this step's quorum (it runs while the forward pass does), then clear grads."""
        self.ft_manager.start_quorum()
        super().zero_grad(set_to_none=set_to_none)

    def _should_step(self) -> bool:
        # A collective inside the replica group: every rank gets the same answer.
        return self.ft_manager.should_commit()
