"""A flat group's step as one compiled pass (`[mixed_precision] compile = true`).

Instead of torch's fused kernel chunk by chunk, the group steps as one inductor graph over its
flat buffers (`_adam`): the low-precision gradients gathered into a flat buffer of their dtype
(2 bytes/param more, kept), read once, and the new parameters written into it and scattered
back; a few fp32 ulp from the eager kernel (another order of roundings).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from containers.norm import local

if TYPE_CHECKING:
    from containers.precision.flat_adam import FlatGroup

__all__ = ["step_compiled"]


def step_compiled(
    flat: FlatGroup,
    group: dict,
    decoupled: bool,
    factor: float,
    grads: list[torch.Tensor | None],
) -> None:
    """`flat`'s step as one inductor graph over the flat buffers: the gradients gathered into
    a flat low-precision buffer (one foreach copy), read once, and the new parameters
    written into the same buffer, then scattered to the model (one foreach copy)."""
    buf = flat.buffers
    if flat._low is None or flat._low.device != buf["master"].device:
        flat._low = torch.zeros_like(buf["master"], dtype=flat._low_dtype)
        flat._low_views = [flat._low[s : s + n] for s, n in zip(flat.starts, flat.sizes)]
    live = [i for i, g in enumerate(grads) if g is not None]
    torch._foreach_copy_([flat._low_views[i] for i in live], [grads[i].view(-1) for i in live])
    for p in flat.model:
        p.grad = None
    grads.clear()
    step = buf["step"][0].item()
    lr, wd = float(group["lr"]), group["weight_decay"]
    beta1, beta2 = group["betas"]
    hyper = torch.tensor(
        [
            factor * (-1.0 if group.get("maximize", False) else 1.0),
            1.0 - lr * wd if decoupled else 1.0,  # decoupled decay: a multiply
            0.0 if decoupled else wd,  # coupled decay: added to the gradient
            1.0 - beta1,
            beta2,
            1.0 - beta2,
            lr / (1.0 - beta1**step),
            math.sqrt(1.0 - beta2**step),
            group["eps"],
        ],
        dtype=torch.float32,
        device=buf["master"].device,
    )
    _compiled_adam()(buf["master"], buf["exp_avg"], buf["exp_avg_sq"], flat._low, hyper)
    out = [local(p).view(-1) for p in flat.model]
    torch._foreach_copy_([out[i] for i in live], [flat._low_views[i] for i in live])


def _adam(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    low: torch.Tensor,
    h: torch.Tensor,
) -> None:
    """Adam/AdamW over flat buffers in one pass: `low` holds the low-precision gradients on
    the way in and the new low-precision parameters on the way out; `h` the hyperparameters
    (`step_compiled`), a tensor so that no value recompiles. torch's fused kernel's
    operations, though not its order of roundings: a few fp32 ulp apart from it."""
    grad = low.float() * h[0] + master * h[2]
    avg = exp_avg.float().lerp(grad, h[3])  # (bf16 moments: widened here, rounded below)
    avg_sq = exp_avg_sq.float() * h[4] + grad * grad * h[5]
    new = master * h[1] - h[6] * avg / (avg_sq.sqrt() / h[7] + h[8])
    exp_avg.copy_(avg)
    exp_avg_sq.copy_(avg_sq)
    master.copy_(new)
    low.copy_(new)


@functools.cache
def _compiled_adam() -> Callable[..., None]:
    """`_adam` compiled on first use (tens of seconds once, then inductor's cache): one graph
    for every group, whatever its size."""
    return torch.compile(_adam, dynamic=True, fullgraph=True)
