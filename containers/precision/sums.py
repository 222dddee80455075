"""What the fp32 masters start from (`from_initial`) and step on (`FullPrecisionSums`).

A bf16 parameter holds only a bf16 gradient, so accumulating micro-batches rounds the running
sum each time; `FullPrecisionSums` adds each gradient as it lands into an fp32 sum (4 bytes a
parameter until the step) and gives the parameters the rounded sums back before the step (for
the finite check, norm and clip) while the masters step on the fp32 sums.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from containers.tensors import local, shaped_like

__all__ = ["FullPrecisionSums", "from_initial"]


class FullPrecisionSums:
    """fp32 gradient sums over a step's micro-batches, kept as the masters' `.grad`."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.master: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> its master

    def watch(self, param: torch.Tensor, master: torch.Tensor) -> None:
        self.master[param] = master
        param.register_post_accumulate_grad_hook(self._add)

    @torch.no_grad()
    def _add(self, param: torch.Tensor) -> None:
        grad, master = local(param.grad), self.master[param]
        if master.grad is None:
            master.grad = shaped_like(grad.to(self.dtype), master)
        else:
            local(master.grad).add_(grad)
        param.grad = None  # so the next micro-batch is not summed in low precision

    @torch.no_grad()
    def restore(self) -> None:
        """Give each summed parameter the rounding of its sum as `.grad`."""
        for param, master in self.master.items():
            if master.grad is not None:
                param.grad = shaped_like(local(master.grad).to(param.dtype), param)

    def clear(self) -> None:
        for master in self.master.values():
            master.grad = None


@torch.no_grad()
def from_initial(master: torch.Tensor, param: torch.Tensor, initial: torch.Tensor) -> None:
    """Set `master` (a fresh fp32 copy of `param`) to `initial` (the whole tensor's
    pre-cast value, sliced as `param`) wherever it still rounds to the parameter's value."""
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank slices its own copy, no communication.
        initial = distribute_tensor(
            initial.to(local(param).device), param.device_mesh, param.placements,
            src_data_rank=None,
        ).to_local()  # fmt: skip
    master, param = local(master), local(param)
    initial = initial.to(master.device, master.dtype)
    if initial.shape == master.shape:
        master.copy_(torch.where(initial.to(param.dtype) == param, initial, master))
