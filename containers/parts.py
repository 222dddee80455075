"""The parts a container is composed of, with the behaviour of plain fp32 training.

Every container runs the same step (`OptimizersContainer.step`); three parts plug into it,
and a fourth may follow it:

- **precision** (`Precision`): what the inner optimizers step (the model's parameters, or fp32
  masters of low-precision ones), how the loss is scaled, how the gradient norm is measured,
  and how a unit of parameters is applied.
- **gate** (`Gate`): whether a step commits (torchft's quorum), and the gradient average
  across replica groups that comes first.
- **timing** (`Timing`): when units apply: after backward, in `step()` (this module), or
  inside backward as each unit's gradients become final (`containers.timing.in_backward`).
- **outer** (`Outer`, none by default): what follows a committed step, with state of its own
  (DiLoCo's outer step, `containers.outer`).

Each part declares the features it brings (`features`); the container refuses a composition
that `containers.rules` lists as one that cannot work, when it is built.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn as nn
from torch.optim import Optimizer

from containers.grouped_step import kernel_skips, step_together
from containers.norm import GlobalNorm, clip_grads

if TYPE_CHECKING:
    from containers.container import OptimizersContainer

__all__ = [
    "Gate",
    "GateLost",
    "Named",
    "Outer",
    "Precision",
    "StepReport",
    "Timing",
    "params_with_grad",
]

Named = list[tuple[str, torch.Tensor]]
"""(FQN, parameter) pairs of one model part or one unit."""


@dataclass(frozen=True)
class StepReport:
    """What one `step()` did, for the trainer to log as it is."""

    committed: bool = True
    """Whether the step was applied (False: nothing changed, except, inside backward, the
    units whose gradients were finite)."""

    skipped: str | None = None
    """Why the step was not applied, if it was not."""

    nonfinite: bool = False
    """Skipped for a non-finite loss or gradients: the batch is spent (running it again
    would give the same), unlike a step the gate did not commit, which the trainer retries."""

    partial: bool = False
    """Skipped in some units only (inside backward): the units whose gradients were finite
    applied their update, so the weights did change."""

    backing_off: bool = False
    """Skipped for an overflow while a dynamic loss scale was still above `min_scale`: the
    scale finding its level, not a failure (the trainer's skip cap counts only the others)."""

    grad_norm: float | None = None
    """Global gradient norm before clipping (unscaled); None where it was not measured."""

    loss_scale: float | None = None
    """The loss scale the next backward uses, for precisions that scale the loss."""

    def metrics(self) -> dict[str, float]:
        """The numeric fields that were measured, by name."""
        fields = ("grad_norm", "loss_scale")
        return {k: v for k in fields if (v := getattr(self, k)) is not None}


def params_with_grad(optimizers: Sequence[Optimizer]) -> list[torch.Tensor]:
    """The parameters of `optimizers` that have a gradient."""
    return [
        p for opt in optimizers for g in opt.param_groups for p in g["params"] if p.grad is not None
    ]


class Precision:
    """fp32 training: the inner optimizers step the model's own parameters.

    A precision answers four kinds of question, in this order of a run's life:
    composition (`features`: "loss_scaling" also makes every non-finite step skip); build
    (`cast_model`, `stepped`, `built`); step (`scale_loss`, `before_step`, `grad_norm`,
    `refusal`, `decided`, `apply`, `zero_grad`, `report`); state beside the optimizers'
    (`state_dict`, `take_state`, `load_state`). This class is the plain answer to each;
    `MasterWeights` (`containers.precision`) is the other.
    """

    keeps_masters = False
    """Whether the inner optimizers step fp32 masters of the model's parameters (their
    update paths are the masters' ones: `containers.optim.paths`)."""

    may_refuse = False
    """Whether `refusal` can ever answer (the container agrees on it across ranks then)."""

    @property
    def features(self) -> Mapping[str, str]:
        """The features of `containers.rules` this precision brings, each with how a refusal
        names it (none: plain fp32)."""
        return {}

    def cast_model(self, model: nn.Module) -> nn.Module:
        """Give `model` the parameter dtype this precision expects (before it is sharded)."""
        return model

    def stepped(self, fqn: str, param: torch.Tensor) -> torch.Tensor:
        """The tensor the inner optimizer steps for the model parameter `param`."""
        return param

    def built(self, optimizers: Sequence[Optimizer]) -> None:
        """Told the inner optimizers, built over the `stepped` tensors."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def before_step(self, optimizers: Sequence[Optimizer]) -> None:
        """Bring what the step needs into place (e.g. state offloaded to CPU)."""

    @torch.no_grad()
    def grad_norm(
        self, params: Sequence[torch.Tensor], over: GlobalNorm | None = None, exact: bool = False
    ) -> torch.Tensor:
        """Global L2 norm of the gradients of `params` (model parameters), each element
        counted once over the job's mesh as `over` says (None: `GlobalNorm(params)`); inf or
        nan if a gradient is, or (unless `exact`: fp64) if a square overflowed fp32."""
        over = over if over is not None else GlobalNorm(params)
        return over([p.grad for p in params], params=params, exact=exact)

    def refusal(self, optimizers: Sequence[Optimizer]) -> str | None:
        """Why `optimizers`' coming update must not apply though its gradients are finite
        (e.g. it could overflow fp16 weights); None: it may."""
        return None

    def decided(self, applied: bool, overflow: bool | None = None) -> None:
        """Told whether the step's gradients were applied and whether they overflowed (by
        default: the step was skipped for non-finite gradients exactly when not applied)."""

    def skips_in_kernel(self, optimizers: Sequence[Optimizer]) -> bool:
        """Whether `apply(optimizers, found_inf=flag)` leaves the skip to the update kernels
        (torch's fused Adam family reads a device flag and changes nothing where it is set),
        so no host sync has to decide it first. A precision with an `apply` or a `decided` of
        its own (told of each decision as the step makes it) answers for itself."""
        return kernel_skips(optimizers)

    @torch.no_grad()
    def apply(
        self,
        optimizers: Sequence[Optimizer],
        grad_norm: torch.Tensor | None = None,
        max_norm: float | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> None:
        """Step `optimizers`, their gradients clipped to `max_norm` by `grad_norm` first;
        like Adam/AdamW groups of all of them in one kernel call (`step_together`). Where
        `found_inf` (a device flag; only if `skips_in_kernel`) is set, nothing changes."""
        if grad_norm is not None:
            clip_grads(params_with_grad(optimizers), grad_norm, max_norm)
        step_together(optimizers, found_inf)

    def zero_grad(self, set_to_none: bool) -> None:
        """Clear gradients the inner optimizers do not own (the model's, beside masters)."""

    def report(self) -> dict[str, Any]:
        """StepReport fields this precision measures."""
        return {}

    def state_dict(self, fqn_of: dict[torch.Tensor, str]) -> dict[str, Any]:
        """Flat entries beside the optimizer state (keys of the same `<kind>.<fqn>` shape)."""
        return {}

    def take_state(self, flat: dict[str, Any], fqn_of: dict[torch.Tensor, str]) -> Any:
        """Remove this precision's entries from `flat` and validate them; change nothing."""
        return None

    def load_state(self, taken: Any) -> None:
        """Apply what `take_state` took, once the optimizer state has loaded."""

    def written(self, params: Sequence[torch.Tensor]) -> None:
        """The inner optimizers' `params` were written outside a step (an outer part's
        step): make the model's own parameters agree (fp32: they are the model's)."""


class GateLost(RuntimeError):
    """The gate can no longer decide whether steps commit (torchft: no quorum within its
    timeout). Raised by `step()` before anything changed: the state is that of the last
    committed step, safe to save."""


class Gate:
    """No gate: every step commits."""

    refusal = "not committed"
    """What `StepReport.skipped` says when `commit()` returns False."""

    @property
    def features(self) -> Mapping[str, str]:
        """The features of `containers.rules` this gate brings, each with how a refusal
        names it (none: every step commits)."""
        return {}

    def on_zero_grad(self) -> None:
        """A new step begins."""

    def reduce_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """Average gradients across replica groups (none here)."""

    def commit(self) -> bool:
        return True


class Outer(Protocol):
    """A post-step part with state of its own: after each committed step it may write the
    stepped weights (DiLoCo's outer step every `sync_steps`, `containers.outer`). A container
    has none unless given one (`outer=`); with one, its non-finite skips are decided on the
    host, since the outer step must know whether the step applied."""

    @property
    def features(self) -> Mapping[str, str]:
        """The features of `containers.rules` this part brings, each with how a refusal
        names it."""
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

    def state_dict(self, fqn_of: dict[torch.Tensor, str]) -> dict[str, Any]:
        """This part's flat entries beside the optimizer state (e.g. `outer.*`)."""
        ...

    def fit_template(self, keys: Collection[str], fqn_of: dict[torch.Tensor, str]) -> None:
        """Make `state_dict()` a template for a checkpoint with these flat keys, where this
        part's entries depend on when it was taken (DiLoCo's average waiting to land)."""
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


class Timing:
    """Units apply after backward, in `step()`; a unit is one model part."""

    in_backward = False

    @property
    def features(self) -> Mapping[str, str]:
        """The features of `containers.rules` this timing brings, each with how a refusal
        names it (none: units apply after backward)."""
        return {}

    def units(self, model_parts: Sequence[nn.Module], parts: list[Named]) -> list[Named]:
        """Split each part's trainable parameters into units with inner optimizers of their own."""
        return [named for named in parts if named]

    def attach(self, container: OptimizersContainer) -> None:
        """Called once the container's units and inner optimizers exist."""

    def on_zero_grad(self) -> None:
        """A new step begins."""

    def finish(self, container: OptimizersContainer) -> None:
        """In `step()`, for timings that apply inside backward: apply what is left."""

    def report(self, container: OptimizersContainer) -> StepReport:
        """In `step()`, after `finish`, for timings that apply inside backward: what the
        step's units did."""
        return StepReport(**container.precision.report())
