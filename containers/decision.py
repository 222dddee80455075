"""The decide stage of the step (`Decision`, an object of `OptimizersContainer`): whether a
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

from containers.norm import GlobalNorm
from containers.parts import Precision, StepReport

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["KERNEL_SKIP_DEVICES", "Decision"]

KERNEL_SKIP_DEVICES = frozenset({"cuda"})
"""Device types whose steps leave the non-finite skip to the kernels: where a host sync costs
(a GPU waits for the host's launches after it). On a CPU the host's decision is free, and a
step that hands the kernels a flag took 1.16x as long (IQR 1.14-1.18; 8 parts of 1.05M
parameters, 1 thread, fused AdamW: torch's found_inf handling is per tensor there)."""


class Decision:
    """Whether a step's gradients may apply, for the container built with `precision`, its
    `global_norm`, the `device` of its parameters and whether that norm is only this rank's
    (`local_norm`: plain tensors without a mesh, whose skip the world must still agree on)."""

    def __init__(
        self, precision: Precision, global_norm: GlobalNorm, device: torch.device, local_norm: bool
    ) -> None:
        self.precision = precision
        self.global_norm = global_norm
        self.device = device
        self.local_norm = local_norm

    def kernels_may_skip(self, optimizers: Sequence[Optimizer]) -> bool:
        """Whether the update kernels of `optimizers` may take the non-finite skip as far as
        the precision and the device go (`Precision.skips_in_kernel`, no refusal, a device
        of `KERNEL_SKIP_DEVICES`)."""
        return (
            self.device.type in KERNEL_SKIP_DEVICES
            and not self.precision.may_refuse
            and self.precision.skips_in_kernel(optimizers)
        )

    def read(
        self, report: StepReport, found: torch.Tensor | None, norm: torch.Tensor | None
    ) -> StepReport:
        """`report` completed by the flag (and norm) a step left to the kernels: the one host
        sync such a step needs, taken when the report is asked."""
        if found is None:
            return report
        value, skip = torch.stack([norm, found]).tolist() if norm is not None else (None, found)
        return self.nonfinite(value) if skip else replace(report, grad_norm=value)

    def nonfinite(self, value: float | None) -> StepReport:
        """The report of a step skipped for a non-finite loss or gradients (of global norm
        `value`, where measured)."""
        return StepReport(
            committed=False,
            skipped="non-finite loss or gradients"
            + (f" (global norm {value})" if value is not None else ""),
            nonfinite=True,
            grad_norm=value,
            **self.precision.report(),
        )

    def refusal(self, optimizers: Sequence[Optimizer]) -> str | None:
        """The precision's refusal of this step's update (`Precision.refusal`), agreed by
        the world: ranks hold different shards and stages, and must skip alike."""
        if not self.precision.may_refuse:
            return None
        why = self.precision.refusal(optimizers)
        if dist.is_initialized() and dist.get_world_size() > 1:
            found = torch.tensor(float(why is not None), device=self.device)
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
            if found and why is None:
                why = "another rank's update could overflow its float16 weights"
        return why

    def measure(
        self, params: list[torch.Tensor], skip_nonfinite: bool, exact: bool = False
    ) -> tuple[Any, float, bool]:
        """The global norm, its value and whether the step may apply. The norm is the
        non-finite check too (a clip needs it anyway), and its value the step's one host
        sync. Where it is not finite, it is measured again in fp64 (`exact`), where only a
        non-finite gradient makes it so (a finite one beyond ~1.8e19 overflows fp32 squares:
        it must neither skip the step nor zero the clip)."""
        norm, bad = self.norm_and_flag(params, skip_nonfinite, exact)
        value, skip = torch.stack([norm, bad]).tolist()
        if skip and skip_nonfinite and not exact:
            return self.measure(params, skip_nonfinite, exact=True)
        return norm.float(), value, not (skip and skip_nonfinite)

    def norm_and_flag(
        self, params: list[torch.Tensor], skip_nonfinite: bool, exact: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The global norm (`exact`: squares summed in fp64) and whether it is not finite (a
        device tensor of the norm's dtype), no host sync."""
        norm = self.precision.grad_norm(params, self.global_norm, exact=exact)
        bad = (~norm.isfinite()).to(norm.dtype)
        if skip_nonfinite and self.local_norm:
            # Plain tensors without a mesh keep a local norm, as torch's clip does; the
            # skip must still be the world's, or the ranks' trainers would part ways.
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return norm, bad
