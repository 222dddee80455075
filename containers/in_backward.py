"""`OptimizersInBackwardContainer`: parameters step during backward and free their gradients.

Parameters are split into units (one per FSDP2 module, else one per module that owns them);
each unit has inner optimizers of its own. A post-accumulate-grad hook on every parameter
counts the unit's ready gradients; when the last one arrives on the last micro-batch of an
optimizer step, the unit steps and its gradients are dropped, so the whole-model gradient
buffer never exists. `step()` and `zero_grad()` do no optimizer work; `step()` only applies
what backward could not finish (parameters that got no gradient in the last micro-batch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer

from containers.base import OptimizersContainer, ParamGroupRule

__all__ = ["OptimizersInBackwardContainer"]


@dataclass(eq=False)
class _Unit:
    params: list[torch.Tensor]
    optimizers: list[Optimizer] = field(default_factory=list)
    ready: int = 0
    stepped: bool = False


class OptimizersInBackwardContainer(OptimizersContainer):
    """Steps each unit of parameters inside backward, as soon as its gradients are final.

    Args:
        model_parts: modules whose trainable parameters are optimized.
        optimizer_cls: optimizer for parameters no rule assigns to another class.
        optimizer_kwargs: constructor kwargs of `optimizer_cls`.
        param_groups: rules that form param groups by FQN (as for the default container).
        gradient_accumulation_steps: backward passes per optimizer step; units step in the
            last one. `zero_grad()` starts counting afresh.
    """

    steps_in_backward = True

    def __init__(
        self,
        model_parts: Sequence[nn.Module],
        optimizer_cls: type[Optimizer],
        optimizer_kwargs: Mapping[str, Any],
        *,
        param_groups: Sequence[ParamGroupRule] = (),
        gradient_accumulation_steps: int = 1,
    ) -> None:
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError(
                f"gradient_accumulation_steps = {gradient_accumulation_steps!r}: expected an "
                "integer >= 1"
            )
        super().__init__(model_parts, optimizer_cls, optimizer_kwargs, param_groups=param_groups)
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self._micro_batch = 0
        self._callback_queued = False
        self._deferred = False
        self._unit_list = [_Unit(params=[]) for _ in range(self._optimizer_units[-1] + 1)]
        for opt, index in zip(self.optimizers, self._optimizer_units):
            unit = self._unit_list[index]
            unit.optimizers.append(opt)
            unit.params.extend(p for g in opt.param_groups for p in g["params"])
        self._unit_of = {p: u for u in self._unit_list for p in u.params}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._unit_of]

    def _units(
        self, parts: list[list[tuple[str, torch.Tensor]]]
    ) -> list[list[tuple[str, torch.Tensor]]]:
        """One unit per FSDP2 module (its gradients arrive together after one reduce-scatter),
        else one per module that directly owns parameters."""
        units: dict[tuple[int, str], list[tuple[str, torch.Tensor]]] = {}
        for part_idx, (part, named) in enumerate(zip(self.model_parts, parts)):
            key_of: dict[torch.Tensor, str] = {}
            fsdp_root: dict[str, str | None] = {}
            for name, module in part.named_modules():
                parent = fsdp_root.get(name.rpartition(".")[0]) if name else None
                fsdp_root[name] = name if isinstance(module, FSDPModule) else parent
                for p in module.parameters(recurse=False):
                    key_of.setdefault(p, fsdp_root[name] if fsdp_root[name] is not None else name)
            for fqn, p in named:
                units.setdefault((part_idx, key_of[p]), []).append((fqn, p))
        return list(units.values())

    # -- hooks ---------------------------------------------------------------------------

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        unit = self._unit_of[param]
        unit.ready += 1
        if self._last_micro_batch() and unit.ready == len(unit.params) and not unit.stepped:
            self._step_unit(unit)

    def _last_micro_batch(self) -> bool:
        return self._micro_batch == self.gradient_accumulation_steps - 1

    def _end_of_backward(self) -> None:
        if not self._deferred:
            # FSDP2 roots of earlier model parts queue their final callbacks (which reduce the
            # root's gradients and fire its hooks) after ours was queued: go to the back of
            # the queue once, behind every callback that backward queued.
            self._deferred = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            return
        self._deferred = False
        self._callback_queued = False
        if self._last_micro_batch():
            self._flush()
        else:
            self._micro_batch += 1
        for unit in self._unit_list:
            unit.ready = 0

    def _step_unit(self, unit: _Unit) -> None:
        for opt in unit.optimizers:
            opt.step()
        for p in unit.params:
            p.grad = None
        unit.stepped = True

    def _flush(self) -> None:
        """Step units that hold gradients but could not step in backward; start a new step."""
        for unit in self._unit_list:
            if not unit.stepped and any(p.grad is not None for p in unit.params):
                self._step_unit(unit)
            unit.stepped = False
        self._micro_batch = 0

    # -- the Optimizer contract ------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if closure is not None:
            raise ValueError(
                f"{type(self).__name__}.step(closure): parameters step inside backward, so a "
                "closure that runs backward cannot be re-evaluated by step(); call backward, "
                "then step()"
            )
        return super().step()

    def _step(self) -> None:
        self._flush()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._micro_batch = 0
        for unit in self._unit_list:
            unit.ready, unit.stepped = 0, False

    def remove_hooks(self) -> None:
        """Detach the post-accumulate-grad hooks (the container stops stepping in backward)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
