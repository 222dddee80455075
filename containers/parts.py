"""The parts a container is composed of, with the behaviour of plain fp32 training.

- **precision** (`Precision`): what the inner optimizers step (parameters or fp32 masters),
  loss scaling, the gradient norm, and how a unit applies.
- **gate** (`Gate`): whether a step commits (torchft), and the gradient average before it.
- **timing** (`Timing`): when units apply: in `step()`, or inside backward
  (`containers.timing.in_backward`).
- **outer** (`Outer`, any number): what follows a committed step, with state of its own
  (DiLoCo, MoE load balancing: `containers.outer`).

Each part declares its `features`; the container refuses compositions `containers.rules` lists.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn as nn
from torch.optim import Optimizer

from containers.grouped_step import step_together
from containers.norm import GlobalNorm, clip_grads
from containers.optim.paths import update_path

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

Named = list[tuple[str, torch.Tensor]]
"""(FQN, parameter) pairs of one model part or one unit."""


@dataclass(frozen=True)
class StepReport:
    """What one `step()` did, for the trainer to log as it is."""

    committed: bool = True
    """Whether the step was applied (inside backward, finite units may apply regardless)."""
    skipped: str | None = None
    """Why the step was not applied, if it was not."""
    nonfinite: bool = False
    """Skipped for a non-finite loss or gradients: the batch is spent (not retried)."""
    partial: bool = False
    """Skipped in some units only (inside backward): the weights did change."""
    backing_off: bool = False
    """Skipped for an overflow while the loss scale was above `min_scale`: the scale finding
    its level, not a failure (the trainer's skip cap does not count it)."""
    grad_norm: float | None = None
    """Global gradient norm before clipping (unscaled); None where it was not measured."""
    loss_scale: float | None = None
    """The loss scale the next backward uses, for precisions that scale the loss."""

    def metrics(self) -> dict[str, float]:
        """The numeric fields that were measured, by name."""
        fields = ("grad_norm", "loss_scale")
        return {k: v for k in fields if (v := getattr(self, k)) is not None}


def step_report(precision: Precision, **fields: Any) -> StepReport:
    """A `StepReport` of `fields` with `precision`'s loss scale and backoff."""
    return StepReport(loss_scale=precision.loss_scale, backing_off=precision.backing_off, **fields)


def params_with_grad(optimizers: Sequence[Optimizer]) -> list[torch.Tensor]:
    """The parameters of `optimizers` that have a gradient."""
    return [
        p for opt in optimizers for g in opt.param_groups for p in g["params"] if p.grad is not None
    ]


class Precision:
    """fp32 training: the inner optimizers step the model's own parameters.

    Hooks by phase: build (`features`, `stepped`, `built`); step (`before_step`,
    `grad_norm`, `refusal`, `decided`, `apply`); checkpoint (`state`). Declared in
    `features`: "masters" (the inner optimizers step fp32 masters), "overflow_refusal"
    (`refusal` may answer: the container agrees on it across ranks), "host_skip" (a skip
    must be decided on the host, never left to the kernels) and the `containers.rules`
    features. The container scales the loss by `loss_scale` and clears the model's
    gradients beside the stepped tensors' on `zero_grad`. `MasterWeights`
    (`containers.precision`) is the other implementation.
    """

    state: PartState | None = None
    """This precision's checkpoint entries beside the optimizer state, if it has any."""

    loss_scale: float | None = None
    """What the container multiplies the loss by before backward, where it is scaled (the
    `StepReport` says it too)."""

    backing_off = False
    """The last step overflowed while a dynamic loss scale was above its floor."""

    @property
    def features(self) -> Mapping[str, str]:
        """What this precision declares, named as refusals name it."""
        return {}

    def stepped(self, fqn: str, param: torch.Tensor) -> torch.Tensor:
        """The tensor the inner optimizer steps for the model parameter `param`."""
        return param

    def built(self, optimizers: Sequence[Optimizer]) -> None:
        """Told the inner optimizers, built over the `stepped` tensors."""

    def update_path(self, opt: Optimizer, index: int) -> str:
        """The update path (`containers.optim.paths.PATHS`) of `opt`'s group `index`."""
        return update_path(opt, opt.param_groups[index])

    def before_step(self, optimizers: Sequence[Optimizer]) -> None:
        """Bring what the step needs into place (e.g. state offloaded to CPU)."""

    @torch.no_grad()
    def grad_norm(
        self, params: Sequence[torch.Tensor], over: GlobalNorm | None = None, exact: bool = False
    ) -> torch.Tensor:
        """Global L2 norm of `params`' gradients over `over` (None: `GlobalNorm(params)`).

        Non-finite if a gradient is, or (unless `exact`: fp64) if a square overflowed fp32.
        """
        over = over if over is not None else GlobalNorm(params)
        return over([p.grad for p in params], params=params, exact=exact)

    def refusal(self, optimizers: Sequence[Optimizer]) -> str | None:
        """Why `optimizers`' coming update must not apply though its gradients are finite
        (e.g. it could overflow fp16 weights); None: it may. Asked only where "overflow_refusal"
        is declared."""
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
        """Clip to `max_norm` by `grad_norm`, then step `optimizers` (`step_together`).

        Where `found_inf` (a device flag, only where `kernel_skips`) is set, nothing changes.
        """
        if grad_norm is not None:
            clip_grads(params_with_grad(optimizers), grad_norm, max_norm)
        step_together(optimizers, found_inf)

    def __repr__(self) -> str:
        return "fp32"


class PartState(Protocol):
    """Checkpoint entries of a part (precision, outer part, EMA) beside the optimizer state,
    flat and keyed `<kind>.<fqn>` like it; `fqn_of` maps each stepped tensor to its FQN."""

    def state_dict(self, fqn_of: dict[torch.Tensor, str]) -> dict[str, Any]:
        """This part's flat entries (tensors as held, so DCP loads into them in place)."""
        ...

    def fit_template(self, keys: Collection[str], fqn_of: dict[torch.Tensor, str]) -> None:
        """Make `state_dict()` a template for a checkpoint with these flat keys."""
        ...

    def forget_template(self) -> None:
        """Undo `fit_template` (the load it was fitted for failed)."""
        ...

    def take_state(self, flat: dict[str, Any], fqn_of: dict[torch.Tensor, str]) -> Any:
        """Remove this part's entries from `flat` and validate them; change nothing."""
        ...

    def load_state(self, taken: Any) -> None:
        """Apply what `take_state` took, once the optimizer state has loaded."""
        ...


class GateLost(RuntimeError):
    """The gate can no longer decide commits (torchft: no quorum in time).

    Raised by `step()` before anything changed, so the state is safe to save.
    """


class Gate:
    """No gate: every step commits."""

    refusal = "not committed"
    """What `StepReport.skipped` says when `commit()` returns False."""

    @property
    def features(self) -> Mapping[str, str]:
        """The `containers.rules` features this gate brings, named as refusals name them."""
        return {}

    def on_zero_grad(self) -> None:
        """A new step begins."""

    def reduce_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """Average gradients across replica groups (none here)."""

    def commit(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "none"


class Outer(PartState, Protocol):
    """A post-step part with state of its own: DiLoCo (may write the stepped weights),
    `LoadBalance` (moves MoE routing biases).

    With one, non-finite skips are decided on the host: it must know whether a step applied.
    """

    @property
    def features(self) -> Mapping[str, str]:
        """The `containers.rules` features this part brings, named as refusals name them."""
        ...

    def attach(self, container: OptimizersContainer) -> None:
        """Called once the container's inner optimizers exist."""
        ...

    def on_zero_grad(self) -> None:
        """A new step begins."""
        ...

    def after_apply(self) -> None:
        """A committed step has applied."""
        ...

    def metrics(self) -> dict[str, float]:
        """Numbers for the step's metrics row, by name."""
        ...


class Timing:
    """Units apply after backward, in `step()`; a unit is one model part."""

    in_backward = False

    @property
    def features(self) -> Mapping[str, str]:
        """The `containers.rules` features this timing brings, named as refusals name them."""
        return {}

    def units(self, model_parts: Sequence[nn.Module], parts: list[Named]) -> list[Named]:
        """Split each part's trainable parameters into units with inner optimizers of their own."""
        return [named for named in parts if named]

    def attach(self, container: OptimizersContainer) -> None:
        """Called once the container's units and inner optimizers exist."""

    def on_zero_grad(self) -> None:
        """A new step begins."""

    def __repr__(self) -> str:
        return "steps after backward"

    def finish(self, container: OptimizersContainer) -> None:
        """In `step()`, for timings that apply inside backward: apply what is left."""

    def report(self, container: OptimizersContainer) -> StepReport:
        """In `step()`, after `finish`: what the step's units did."""
        return step_report(container.precision)
