"""The part protocols of a container, each default being plain fp32 training."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn as nn
from torch.optim import Optimizer

from containers.norm import GlobalNorm, clip_grads
from containers.tensors import local
from containers.update.driver import plan_in, step_together
from containers.update.plan import Plan, plan_of

if TYPE_CHECKING:
    from containers.container import OptimizersContainer

__all__ = [
    "Gate",
    "GateLost",
    "Named",
    "Outer",
    "PartState",
    "Precision",
    "StepReport",
    "Timing",
    "params_with_grad",
    "step_report",
]

Named = list[tuple[str, torch.Tensor]]  # (FQN, parameter) of one model part or unit


@dataclass(frozen=True)
class StepReport:
    """What one `step()` did.

    Attributes:
        skipped: why it did not apply (`committed` False).
        nonfinite: skipped for a non-finite loss or gradients: the batch is spent.
        partial: skipped in some units only (inside backward): the weights did change.
        backing_off: an overflow skip while the loss scale was above `min_scale`.
        grad_norm: unscaled global norm before clipping, where measured.
    """

    committed: bool = True
    skipped: str | None = None
    nonfinite: bool = False
    partial: bool = False
    backing_off: bool = False
    grad_norm: float | None = None
    loss_scale: float | None = None

    def metrics(self) -> dict[str, float]:
        fields = ("grad_norm", "loss_scale")
        return {k: v for k in fields if (v := getattr(self, k)) is not None}


def step_report(precision: Precision, **fields: Any) -> StepReport:
    return StepReport(loss_scale=precision.loss_scale, backing_off=precision.backing_off, **fields)


def params_with_grad(optimizers: Sequence[Optimizer]) -> list[torch.Tensor]:
    return [
        p for opt in optimizers for g in opt.param_groups for p in g["params"] if p.grad is not None
    ]


class Precision:
    """fp32 training: the inner optimizers step the model's own parameters.

    `features` may declare, beside the `containers.rules` ones: "masters", "overflow_refusal"
    (`refusal` may answer) and "host_skip" (a skip is decided on the host, not in kernels).
    """

    state: PartState | None = None  # checkpoint entries beside the optimizer state
    loss_scale: float | None = None
    backing_off = False

    @property
    def features(self) -> Mapping[str, str]:
        """What this precision declares, named as refusals name it."""
        return {}

    def stepped(self, fqn: str, param: torch.Tensor) -> torch.Tensor:
        """The tensor the inner optimizer steps for `param`."""
        return param

    def built(self, optimizers: Sequence[Optimizer]) -> None:
        pass

    def plan(self, opt: Optimizer, index: int) -> Plan:
        """How `opt`'s group `index` steps (`containers.update.plan`): the plan the optimizer
        made for it, if it keeps plans; its name is the group's `update path` line."""
        group = opt.param_groups[index]
        return plan_in(opt, group) or plan_of(type(opt), group)

    def weight(self, stepped: torch.Tensor) -> torch.Tensor:
        """The value of a tensor the optimizers step (for an EMA, DiLoCo's outer step): the
        tensor itself, or a new one decoded from the form its precision keeps it in."""
        return stepped

    @torch.no_grad()
    def set_weight(self, stepped: torch.Tensor, value: torch.Tensor) -> None:
        """Set a stepped tensor's local piece to `value` (its model parameter follows)."""
        if local(stepped).data_ptr() != value.data_ptr():
            local(stepped).copy_(value)

    def before_step(self, optimizers: Sequence[Optimizer]) -> None:
        """Bring what the step needs into place (e.g. offloaded state)."""

    @torch.no_grad()
    def grad_norm(
        self, params: Sequence[torch.Tensor], over: GlobalNorm | None = None, exact: bool = False
    ) -> torch.Tensor:
        """Global L2 norm of `params`' gradients; non-finite if a gradient is, or (unless
        `exact`: fp64) if a square overflowed fp32."""
        over = over if over is not None else GlobalNorm(params)
        return over([p.grad for p in params], params=params, exact=exact)

    def refusal(self, optimizers: Sequence[Optimizer]) -> str | None:
        """Why a finite update must not apply (it could overflow fp16 weights); None: it may."""
        return None

    def decided(self, applied: bool, overflow: bool | None = None) -> None:
        """Told whether the step applied and whether it overflowed (default: not applied)."""

    @torch.no_grad()
    def apply(
        self,
        optimizers: Sequence[Optimizer],
        grad_norm: torch.Tensor | None = None,
        max_norm: float | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> None:
        """Clip, then step; nothing changes where the device flag `found_inf` is set."""
        if grad_norm is not None:
            clip_grads(params_with_grad(optimizers), grad_norm, max_norm)
        step_together(optimizers, found_inf)

    def __repr__(self) -> str:
        return "fp32"


class PartState(Protocol):
    """Flat checkpoint entries `<kind>.<fqn>` of a part (tensors as held: DCP loads in place).
    `fit_template` fits `state_dict()` to a checkpoint's keys; `take_state` removes and checks
    the part's entries, changing nothing; `load_state` applies them after the optimizers'."""

    def state_dict(self, fqn_of: dict[torch.Tensor, str]) -> dict[str, Any]: ...

    def fit_template(self, keys: Collection[str], fqn_of: dict[torch.Tensor, str]) -> None: ...

    def forget_template(self) -> None: ...

    def take_state(self, flat: dict[str, Any], fqn_of: dict[torch.Tensor, str]) -> Any: ...

    def load_state(self, taken: Any) -> None: ...


class GateLost(RuntimeError):
    """The gate can no longer decide commits; raised before anything changed (safe to save)."""


class Gate:
    """No gate: every step commits."""

    refusal = "not committed"  # `StepReport.skipped` when `commit()` is False

    @property
    def features(self) -> Mapping[str, str]:
        return {}

    def on_zero_grad(self) -> None:
        """A new step begins."""

    def reduce_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """Average gradients across replica groups."""

    def commit(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "none"


class Outer(PartState, Protocol):
    """A post-step part with state of its own (DiLoCo, `LoadBalance`): `attach` once the inner
    optimizers exist, `on_zero_grad`, `after_apply` a committed step, `metrics` for the step's
    row. With one, non-finite skips are decided on the host."""

    @property
    def features(self) -> Mapping[str, str]: ...

    def attach(self, container: OptimizersContainer) -> None: ...

    def on_zero_grad(self) -> None: ...

    def after_apply(self) -> None: ...

    def metrics(self) -> dict[str, float]: ...


class Timing:
    """Units apply after backward, in `step()`; a unit is one model part."""

    in_backward = False

    @property
    def features(self) -> Mapping[str, str]:
        return {}

    def units(self, model_parts: Sequence[nn.Module], parts: list[Named]) -> list[Named]:
        """Split each part's trainable parameters into units with inner optimizers of their own."""
        return [named for named in parts if named]

    def attach(self, container: OptimizersContainer) -> None:
        """Called once the container's units and inner optimizers exist."""

    def on_zero_grad(self) -> None:
        pass

    def __repr__(self) -> str:
        return "steps after backward"

    def finish(self, container: OptimizersContainer) -> None:
        """In `step()`, for timings that apply inside backward: apply what is left."""

    def report(self, container: OptimizersContainer) -> StepReport:
        """In `step()`, after `finish`: what the step's units did."""
        return step_report(container.precision)
