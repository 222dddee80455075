"""What `MasterWeights`' fp32 masters start from and step on, beside the low-precision model.

`from_initial`: the masters start from the full-precision values the model was built with
(`MasterWeights.cast_model` keeps them), not from their rounding.

`FullPrecisionSums` (`[mixed_precision] grad_accumulation_dtype = "float32"`): gradients
summed over micro-batches in fp32. A bf16 parameter can only hold a bf16 gradient, so autograd
and FSDP2 add each micro-batch's gradient into the one before in bf16: every addition rounds
the running sum to 8 significant bits. On the debug job with 4 micro-batches that cost the
container 3% of loss against FSDP2's bf16 policy, which sums fp32 gradients
(benchmarks/README.md). Here a hook on each parameter takes the gradient as soon as it lands
(after FSDP2's reduce-scatter, once per micro-batch), adds it into an fp32 sum and drops it,
so the next micro-batch lands on no gradient and is not rounded into one. Before the step the
parameters get the bf16 rounding of their sums back as `.grad` (what the finite check, the
norm and the clip read, as before); the masters step on the fp32 sums themselves: flat groups
(`containers.precision.flat_adam`, with torch's fused kernel) read them in place of the gradients,
other optimizers through `containers.precision.eager.step_masters`.

Costs: the fp32 sums (4 bytes/param instead of the 2 of a bf16 gradient, from the first
micro-batch to the step, plus the bf16 copy the step makes) and one add per micro-batch. With
one micro-batch per step the result is the same, bitwise. The reduce itself still rounds once
per micro-batch (FSDP2 casts its reduce-scatter output to the parameter's dtype).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from containers.tensors import local, shaped_like

__all__ = ["FullPrecisionSums", "from_initial"]


class FullPrecisionSums:
    """The fp32 sums of the gradients of the parameters it watches, over the micro-batches of
    one step."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.sums: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> local fp32 sum

    def watch(self, param: torch.Tensor) -> None:
        """Sum `param`'s gradients from now on (a hook that runs after each accumulation)."""
        param.register_post_accumulate_grad_hook(self._add)

    @torch.no_grad()
    def _add(self, param: torch.Tensor) -> None:
        grad = local(param.grad)
        total = self.sums.get(param)
        if total is None:
            self.sums[param] = grad.to(self.dtype)
        else:
            total.add_(grad)
        param.grad = None  # the next micro-batch lands on nothing: no low-precision sum

    @torch.no_grad()
    def restore(self) -> None:
        """Give each summed parameter the rounding of its sum as `.grad` (in its own dtype)."""
        for param, total in self.sums.items():
            param.grad = shaped_like(total.to(param.dtype), param)

    def clear(self) -> None:
        self.sums.clear()


@torch.no_grad()
def from_initial(master: torch.Tensor, param: torch.Tensor, initial: torch.Tensor) -> None:
    """Overwrite `master` (a fresh fp32 copy of the model parameter `param`) with `initial`,
    the whole tensor's full-precision value before the cast, sliced as `param` is sharded,
    wherever it rounds to the parameter's value (elsewhere the parameter changed since the
    cast, e.g. a load: its own value stays)."""
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
