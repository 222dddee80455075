"""`MixedPrecisionOptimizersContainer`: the container with the `MasterWeights` precision."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch.nn as nn
from torch.optim import Optimizer

from containers.container import OptimizersContainer
from containers.precision.loss_scaler import LossScaler
from containers.precision.master_weights import MasterWeights
from containers.precision.remainders import LoadPlanner
from containers.precision.settings import MixedPrecisionSettings

__all__ = ["MixedPrecisionOptimizersContainer", "load_planner"]


class MixedPrecisionOptimizersContainer(OptimizersContainer):
    """An `OptimizersContainer` with the `MasterWeights` precision (`precision`, e.g. the one
    the model was cast with, else built of `settings`). Call `backward(loss)` (or
    `scale_loss(loss).backward()`), then `step()`; a `step()` while `offload()`ed reloads first.
    `max_norm` defaults to 0: the norm is still measured, for the overflow check.
    """

    def __init__(
        self,
        model_parts: Sequence[nn.Module],
        optimizer_cls: type[Optimizer],
        optimizer_kwargs: Mapping[str, Any],
        *,
        settings: MixedPrecisionSettings | None = None,
        precision: MasterWeights | None = None,
        max_norm: float | None = 0.0,
        **kwargs: Any,
    ) -> None:
        self.precision: MasterWeights = precision or MasterWeights(settings)
        super().__init__(
            model_parts,
            optimizer_cls,
            optimizer_kwargs,
            precision=self.precision,
            max_norm=max_norm,
            **kwargs,
        )
        self.precision._initial.clear()  # (other pipeline stages' parameters)

    @property
    def scaler(self) -> LossScaler:
        return self.precision.scaler

    @property
    def loss_scale(self) -> float:
        return self.precision.scaler.scale

    @property
    def offloaded(self) -> bool:
        return self.precision.offloaded

    def offload(self) -> None:
        self.precision.offload(self.optimizers)

    def reload(self) -> None:
        self.precision.reload(self.optimizers)


@contextlib.contextmanager
def load_planner(states: Mapping[str, Any]) -> Iterator[LoadPlanner | None]:
    """The DCP load planner for one `dcp.load(states, planner=...)` (None: DCP's default)."""
    precisions = [
        s.precision
        for s in states.values()
        if isinstance(getattr(s, "precision", None), MasterWeights) and s.precision.remainders
    ]
    if not precisions:
        yield None
        return
    with contextlib.ExitStack() as stack:
        sinks = {}
        for precision in precisions:
            sinks.update(stack.enter_context(precision.state.lazy_masters()))
        yield LoadPlanner(sinks)
