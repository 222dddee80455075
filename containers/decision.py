"""The decide stage of the step (`Decision`, a mixin of `OptimizersContainer`): whether a
step's gradients may apply, decided once and agreed by the world, and the report of it.

With a clip the global norm is the non-finite check (a clip reads the gradients anyway); its
value is the step's one host sync, and a norm that is not finite is measured again in fp64,
where only a non-finite gradient makes it so. Without a clip, one read that only checks. On a
device of `KERNEL_SKIP_DEVICES` (CUDA), where nothing else follows the decision, it is a
device flag that torch's fused kernels (or the compiled graph) read instead: the norm's
squares summed in fp64 from the start, no host sync; `last_report` reads flag and norm when
asked.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from containers.parts import StepReport

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["KERNEL_SKIP_DEVICES", "Decision"]

KERNEL_SKIP_DEVICES = frozenset({"cuda"})
"""Device types whose steps leave the non-finite skip to the kernels: where a host sync costs
(a GPU waits for the host's launches after it). On a CPU the host's decision is free, and a
step that hands the kernels a flag took 1.16x as long (IQR 1.14-1.18; 8 parts of 1.05M
parameters, 1 thread, fused AdamW: torch's found_inf handling is per tensor there)."""


class Decision:
    """What `OptimizersContainer` decides before it applies a step, and reports after."""

    def _left_to_kernels(self, found: torch.Tensor, norm: torch.Tensor | None = None) -> StepReport:
        """Apply with the non-finite skip left to the kernels (`found`, a device flag) and
        the gradients clipped by `norm` (None: no clip); no host sync: the report reads the
        flag and the norm when asked."""
        self._with_hooks(
            lambda: self.precision.apply(self.optimizers, norm, self.max_norm, found_inf=found)
        )
        self._found_inf, self._norm = found, norm
        return StepReport(**self.precision.report())

    def leaves_skip_to_kernels(
        self, optimizers: Sequence[Optimizer], per_unit: bool = False
    ) -> bool:
        """Whether a step (or a unit's, `per_unit`) may leave its non-finite skip to the
        update kernels of `optimizers` (`Precision.skips_in_kernel`): nothing else follows
        the decision (no step hooks around it, no EMA, no refusal, a gate with nothing to do
        after the update), on a device of `KERNEL_SKIP_DEVICES`."""
        hooks = not per_unit and (self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks)
        return (
            self._params[0].device.type in KERNEL_SKIP_DEVICES
            and not hooks
            and self.ema is None
            and not self.precision.may_refuse
            and not self.gate.works_after_apply
            and self.precision.skips_in_kernel(optimizers)
        )

    @property
    def last_report(self) -> StepReport:
        """What the last `step()` did. A step that left its non-finite skip to the kernels
        is reported here, when asked: the one host sync it needs."""
        found, self._found_inf = self._found_inf, None
        norm, self._norm = self._norm, None
        if found is not None:
            value, skip = torch.stack([norm, found]).tolist() if norm is not None else (None, found)
            if skip:
                self._last_report = StepReport(
                    committed=False,
                    skipped="non-finite loss or gradients"
                    + (f" (global norm {value})" if value is not None else ""),
                    nonfinite=True,
                    grad_norm=value,
                    **self.precision.report(),
                )
            else:
                self._last_report = replace(self._last_report, grad_norm=value)
        return self._last_report

    @last_report.setter
    def last_report(self, report: StepReport) -> None:
        self._last_report = report

    def _refusal(self) -> str | None:
        """The precision's refusal of this step's update (`Precision.refusal`), agreed by
        the world: ranks hold different shards and stages, and must skip alike."""
        if not self.precision.may_refuse:
            return None
        why = self.precision.refusal(self.optimizers)
        if dist.is_initialized() and dist.get_world_size() > 1:
            found = torch.tensor(float(why is not None), device=self._params[0].device)
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
            if found and why is None:
                why = "another rank's update could overflow its float16 weights"
        return why

    def _measure(self, params: list[torch.Tensor], exact: bool = False) -> tuple[Any, float, bool]:
        """The global norm, its value and whether the step may apply. The norm is the
        non-finite check too (a clip needs it anyway), and its value the step's one host
        sync. Where it is not finite, it is measured again in fp64 (`exact`), where only a
        non-finite gradient makes it so (a finite one beyond ~1.8e19 overflows fp32 squares:
        it must neither skip the step nor zero the clip)."""
        norm, bad = self._norm_and_flag(params, exact)
        value, skip = torch.stack([norm, bad]).tolist()
        if skip and self.skip_nonfinite and not exact:
            return self._measure(params, exact=True)
        return norm.float(), value, not (skip and self.skip_nonfinite)

    def _norm_and_flag(
        self, params: list[torch.Tensor], exact: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The global norm (`exact`: squares summed in fp64) and whether it is not finite (a
        device tensor of the norm's dtype), no host sync."""
        norm = self.precision.grad_norm(params, self.global_norm, exact=exact)
        bad = (~norm.isfinite()).to(norm.dtype)
        if self.skip_nonfinite and self._local_norm:
            # Plain tensors without a mesh keep a local norm, as torch's clip does; the
            # skip must still be the world's, or the ranks' trainers would part ways.
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return norm, bad
