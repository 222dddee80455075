"""`InBackward` timing: each unit applies in a post-accumulate-grad hook once its last
gradient of the step's last micro-batch lands, and drops its gradients, so the whole-model
gradient buffer never exists. `step()` applies what backward could not finish."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer

from containers.container import OptimizersContainer, Unit
from containers.parts import Named, StepReport, Timing, step_report

__all__ = ["InBackward", "OptimizersInBackwardContainer"]


class InBackward(Timing):
    """Apply each unit inside the last backward of the step that reaches it."""

    in_backward = True

    def __init__(self, gradient_accumulation_steps: int = 1) -> None:
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError(
                f"gradient_accumulation_steps = {gradient_accumulation_steps!r}: expected an "
                "integer >= 1"
            )
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self._callback_queued = False
        self._deferred = False
        self._ready: dict[Unit, int] = {}  # gradients landed in this backward pass
        self._passes: dict[Unit, int] = {}  # backward passes that reached the unit this step
        self._stepped: set[Unit] = set()
        self._skipped = 0  # units skipped on this rank this step
        self._flags: list[torch.Tensor] = []  # of units that left their skip to the kernels

    @property
    def features(self) -> dict[str, str]:  # type: ignore[override]
        return {"in_backward": "InBackward (units step inside backward)"}

    def __repr__(self) -> str:
        every = self.gradient_accumulation_steps
        return "steps in backward" + (f" (every {every} passes)" if every > 1 else "")

    def units(self, model_parts: Sequence[nn.Module], parts: list[Named]) -> list[Named]:
        """One unit per FSDP2 module (one reduce-scatter), else per module owning parameters."""
        units: dict[tuple[int, str], Named] = {}
        for part_idx, (part, named) in enumerate(zip(model_parts, parts)):
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

    def attach(self, container: OptimizersContainer) -> None:
        self._container = container
        self._ready = dict.fromkeys(container.units, 0)
        self._passes = dict.fromkeys(container.units, 0)
        self._unit_of = {p: u for u in container.units for p in u.params}
        for p in self._unit_of:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, param: torch.Tensor) -> None:
        # FSDP2 under a pipeline schedule reduces gradients after backward, outside it.
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward and not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        unit = self._unit_of[param]
        self._ready[unit] += 1
        if self._ready[unit] == len(unit.params):
            self._pass_done(unit)

    def _pass_done(self, unit: Unit) -> None:
        self._ready[unit] = 0
        self._passes[unit] += 1
        if self._passes[unit] == self.gradient_accumulation_steps and unit not in self._stepped:
            self._apply(unit)

    def _apply(self, unit: Unit) -> None:
        applied = self._container.apply_unit(unit)
        if isinstance(applied, torch.Tensor):  # left to the kernels: `report` sums the flags
            self._flags.append(applied)
        elif not applied:
            self._skipped += 1
        for p in unit.params:
            p.grad = None
        self._stepped.add(unit)

    def _end_of_backward(self) -> None:
        if not self._deferred:
            # Re-queue once, behind the final callbacks FSDP2 roots of earlier parts queue
            # after ours (they reduce gradients and fire our hooks).
            self._deferred = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            return
        self._deferred = False
        self._callback_queued = False
        for unit, landed in self._ready.items():
            if landed:  # the pass reached only some of the unit's parameters
                self._pass_done(unit)

    def finish(self, container: OptimizersContainer) -> None:
        for unit in self._ready:
            if unit not in self._stepped and any(p.grad is not None for p in unit.params):
                self._apply(unit)
        self._new_step()

    def report(self, container: OptimizersContainer) -> StepReport:
        """Skipped if any unit on any rank was; `partial` if any unit applied anyway."""
        skipped, flags, units = self._skipped, self._flags, len(container.units)
        self._skipped, self._flags = 0, []
        world = dist.is_initialized() and dist.get_world_size() > 1
        if flags or world:
            # Ranks hold different shards and must agree; kernel flags are read here (the
            # step's one host sync).
            device = container.units[0].params[0].device
            counts = torch.tensor([float(skipped), float(units - skipped)], device=device)
            if flags:
                found = torch.stack(flags).sum()
                counts += torch.stack([found, -found])
            if world:
                dist.all_reduce(counts, op=dist.ReduceOp.MAX)
            skipped, applied = (int(c) for c in counts.tolist())
        else:
            applied = units - skipped
        if not skipped:
            return step_report(container.precision)
        return step_report(
            container.precision,
            committed=False,
            skipped=f"non-finite loss or gradients in {skipped} of {units} units"
            + (" (the units with finite gradients applied)" if applied else ""),
            nonfinite=True,
            partial=applied > 0,
        )

    def on_zero_grad(self) -> None:
        self._new_step()
        self._skipped, self._flags = 0, []

    def _new_step(self) -> None:
        self._ready = dict.fromkeys(self._ready, 0)
        self._passes = dict.fromkeys(self._passes, 0)
        self._stepped.clear()
        # (a backward a refusal ended never ran its end-of-backward callback)
        self._callback_queued = self._deferred = False


class OptimizersInBackwardContainer(OptimizersContainer):
    """An `OptimizersContainer` whose units step inside backward (`InBackward`)."""

    def __init__(
        self,
        model_parts: Sequence[nn.Module],
        optimizer_cls: type[Optimizer],
        optimizer_kwargs: Mapping[str, Any],
        *,
        gradient_accumulation_steps: int = 1,
        **kwargs: Any,
    ) -> None:
        timing = InBackward(gradient_accumulation_steps)
        super().__init__(model_parts, optimizer_cls, optimizer_kwargs, timing=timing, **kwargs)

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.timing.gradient_accumulation_steps
