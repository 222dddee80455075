"""The decide stage of the step, agreed by the world (ARCHITECTURE.md, "One step")."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from containers.grouped_step import kernel_skips
from containers.norm import GlobalNorm
from containers.parts import Precision, StepReport, step_report

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["KERNEL_SKIP_DEVICES", "Decision"]

# Where a host sync stalls the device; on CPU it is free and torch's found_inf path slower.
KERNEL_SKIP_DEVICES = frozenset({"cuda"})


class Decision:
    """Whether a step's gradients may apply (`local_norm`: this rank's, agreed after)."""

    def __init__(
        self, precision: Precision, global_norm: GlobalNorm, device: torch.device, local_norm: bool
    ) -> None:
        self.precision = precision
        self.may_refuse = "overflow_refusal" in precision.features
        self.host_skip = "host_skip" in precision.features
        self.global_norm = global_norm
        self.device = device
        self.local_norm = local_norm

    def kernels_may_skip(self, optimizers: Sequence[Optimizer]) -> bool:
        """Whether the precision and device let `optimizers`' kernels take the skip."""
        return (
            self.device.type in KERNEL_SKIP_DEVICES
            and not self.may_refuse
            and not self.host_skip
            and kernel_skips(optimizers)
        )

    def read(
        self, report: StepReport, found: torch.Tensor | None, norm: torch.Tensor | None
    ) -> StepReport:
        """`report` completed by the flag (and norm) a step left to the kernels (one sync)."""
        if found is None:
            return report
        value, skip = torch.stack([norm, found]).tolist() if norm is not None else (None, found)
        return self.nonfinite(value) if skip else replace(report, grad_norm=value)

    def nonfinite(self, value: float | None) -> StepReport:
        return step_report(
            self.precision,
            committed=False,
            skipped="non-finite loss or gradients"
            + (f" (global norm {value})" if value is not None else ""),
            nonfinite=True,
            grad_norm=value,
        )

    def refusal(self, optimizers: Sequence[Optimizer]) -> str | None:
        """`Precision.refusal`, agreed by the world (ranks hold different shards)."""
        if not self.may_refuse:
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
        """The global norm, its value and whether the step may apply (one host sync). A
        non-finite norm is measured again in fp64: a finite gradient beyond ~1.8e19 overflows
        fp32 squares and must neither skip the step nor zero the clip."""
        norm, bad = self.norm_and_flag(params, skip_nonfinite, exact)
        value, skip = torch.stack([norm, bad]).tolist()
        if skip and skip_nonfinite and not exact:
            return self.measure(params, skip_nonfinite, exact=True)
        return norm.float(), value, not (skip and skip_nonfinite)

    def norm_and_flag(
        self, params: list[torch.Tensor], skip_nonfinite: bool, exact: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The global norm and a not-finite flag of its dtype; no sync."""
        norm = self.precision.grad_norm(params, self.global_norm, exact=exact)
        bad = (~norm.isfinite()).to(norm.dtype)
        if skip_nonfinite and self.local_norm:
            # A local norm (as torch's clip keeps); the skip must still be the world's.
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return norm, bad
