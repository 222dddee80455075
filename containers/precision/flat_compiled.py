"""A flat group's step as one compiled pass (`[mixed_precision] compile = true`).

Instead of torch's fused kernel chunk by chunk over fp32 scratch, the group steps as one
inductor graph (`_adam`) over its tensors where they lie: each low-precision gradient read
once, its master (or, with remainders, its bf16 parameter and 16-bit remainder), moments and
parameter read and written in the same pass, per tensor, the masters and moments as views of
the flat buffers. Nothing is gathered or scattered, no scratch is used, and no value is read
back to the host (the step count has a host copy, `FlatGroup.count`; the hyperparameters go
to the device in a non-blocking copy), so on a GPU the step runs at the bandwidth of the
bytes it moves. A few fp32 ulp from the eager kernel (another order of roundings).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from containers.norm import local
from containers.precision.remainders import HALF_ULP

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
    """`flat`'s step (its count already advanced) as one inductor graph over its tensors;
    drops the gradients."""
    live = [i for i, g in enumerate(grads) if g is not None]
    taken = [grads[i] for i in live]
    for p in flat.model:
        p.grad = None
    grads.clear()
    lr, wd = float(group["lr"]), group["weight_decay"]
    beta1, beta2 = group["betas"]
    step = flat.count
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
    )
    device = flat.buffers["exp_avg"].device
    if device.type != "cpu":  # pinned, so the copy does not wait for the device
        hyper = hyper.pin_memory().to(device, non_blocking=True)
    views = flat.views
    pick = lambda name: [views[name][i] for i in live]  # noqa: E731
    _compiled_adam()(
        taken,
        [local(flat.model[i]) for i in live],
        pick("remainder" if flat.remainders else "master"),
        pick("exp_avg"),
        pick("exp_avg_sq"),
        hyper,
        flat.remainders,
    )


def _adam(
    grads: list[torch.Tensor],
    params: list[torch.Tensor] | None,
    masters: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    h: torch.Tensor,
    remainders: bool,
) -> None:
    """Adam/AdamW, tensor by tensor, in one graph: `params` the low-precision parameters
    (written; None: `masters` are the parameters), `masters` their fp32 masters or, with
    `remainders`, the int16 remainders
    that complete the bf16 `params` (`containers.precision.remainders`); `h` the
    hyperparameters (`step_compiled`), a tensor so that no value recompiles. torch's fused
    kernel's operations, though not its order of roundings: a few fp32 ulp apart from it."""
    for grad, param, master, exp_avg, exp_avg_sq in zip(
        grads, params or [None] * len(grads), masters, exp_avgs, exp_avg_sqs
    ):
        if remainders:
            high = param.view(torch.int16).to(torch.int32)
            value = (high * 65536 + master.to(torch.int32)).view(torch.float32)
        else:
            value = master
        g = grad.float() * h[0] + value * h[2]
        avg = exp_avg.float().lerp(g, h[3])  # (bf16 moments: widened here, rounded below)
        avg_sq = exp_avg_sq.float() * h[4] + g * g * h[5]
        new = value * h[1] - h[6] * avg / (avg_sq.sqrt() / h[7] + h[8])
        exp_avg.copy_(avg)
        exp_avg_sq.copy_(avg_sq)
        if remainders:  # round half away from zero; the rest is the remainder
            bits = new.view(torch.int32)
            high = (bits + HALF_ULP) >> 16
            master.copy_(bits - high * 65536)
            param.copy_(high.to(torch.int16).view(torch.bfloat16))
        else:
            master.copy_(new)
            if param is not None:
                param.copy_(new)


@functools.cache
def _compiled_adam() -> Callable[..., None]:
    """`_adam` compiled on first use (tens of seconds once, then inductor's cache): one graph
    per number of tensors and their dtypes and ranks, whatever their sizes."""
    return torch.compile(_adam, dynamic=True, fullgraph=True)
