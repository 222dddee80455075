"""`MixedPrecisionOptimizersContainer`: the container with the `MasterWeights` precision."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from containers.container import OptimizersContainer
from containers.ema import ShadowWeights
from containers.parts import Gate, Outer, Timing
from containers.precision.loss_scaler import LossScaler
from containers.precision.master_weights import MasterWeights
from containers.precision.remainders import LoadPlanner
from containers.precision.settings import MixedPrecisionSettings
from containers.state.param_groups import ParamGroupRule

__all__ = ["MixedPrecisionOptimizersContainer", "load_planner"]


class MixedPrecisionOptimizersContainer(OptimizersContainer):
    """An `OptimizersContainer` with the `MasterWeights` precision.

    Call `scale_loss(loss).backward()` (or `backward(loss)`), then `step()`. `offload()` moves
    masters and optimizer state to CPU; a `step()` while offloaded reloads first.

    Args:
        model_parts: modules whose trainable parameters are all of `settings.param_dtype`.
        optimizer_cls: optimizer for the masters (any `torch.optim` one).
        optimizer_kwargs: its constructor kwargs.
        param_groups: rules that form param groups by FQN.
        settings: dtypes, loss scaling, update path; default `MixedPrecisionSettings()`.
        precision: a `MasterWeights` built already (e.g. the one the model was cast with);
            replaces `settings`.
        max_norm: clip the global gradient norm to this; 0 or None: no clip (the norm is
            still measured for the overflow check).
        gate: whether a step commits (e.g. `containers.TorchFTGate`).
        timing: when units apply (e.g. `containers.InBackward`; needs loss scaling 'none').
        outer: what follows each committed step (e.g. `containers.DiLoCo`: its outer step
            runs on the fp32 masters).
        mesh: the job's named DeviceMesh for the global norm; None: one stage over the world.
    """

    def __init__(
        self,
        model_parts: Sequence[nn.Module],
        optimizer_cls: type[Optimizer],
        optimizer_kwargs: Mapping[str, Any],
        *,
        param_groups: Sequence[ParamGroupRule] = (),
        settings: MixedPrecisionSettings | None = None,
        precision: MasterWeights | None = None,
        max_norm: float | None = 0.0,
        gate: Gate | None = None,
        timing: Timing | None = None,
        outer: Outer | None = None,
        mesh: DeviceMesh | None = None,
        ema: ShadowWeights | None = None,
    ) -> None:
        self.precision: MasterWeights = precision or MasterWeights(settings)
        super().__init__(
            model_parts,
            optimizer_cls,
            optimizer_kwargs,
            param_groups=param_groups,
            precision=self.precision,
            gate=gate,
            timing=timing,
            outer=outer,
            max_norm=max_norm,
            mesh=mesh,
            ema=ema,
        )
        # drop initial values no master took (other pipeline stages' parameters)
        self.precision._initial.clear()

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
        """Move master weights and optimizer state to CPU (pinned, non-blocking on CUDA)."""
        self.precision.offload(self.optimizers)

    def reload(self) -> None:
        """Move master weights and optimizer state back to the parameters' device."""
        self.precision.reload(self.optimizers)


@contextlib.contextmanager
def load_planner(states: Mapping[str, Any]) -> Iterator[LoadPlanner | None]:
    """The DCP load planner for one `dcp.load(states, planner=...)`: a
    `remainders.LoadPlanner` if any state keeps remainders, else None (DCP's default)."""
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
