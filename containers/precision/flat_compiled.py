"""A flat group's step as one compiled pass (`[mixed_precision] compile = true`).

Instead of torch's fused kernel chunk by chunk over fp32 scratch, the group steps as one
inductor graph (`containers.optim.compiled_adam`) over its tensors where they lie: each
low-precision gradient read once, its master (or, with remainders, its bf16 parameter and
16-bit remainder), moments and parameter read and written in the same pass, the masters and
moments as views of the flat buffers. Nothing is gathered or scattered, no scratch is used,
and nothing waits for the host. A few fp32 ulp from the eager kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from containers.norm import local
from containers.optim.compiled_adam import compiled_adam

if TYPE_CHECKING:
    from containers.precision.flat_adam import FlatGroup

__all__ = ["step_compiled"]


def step_compiled(
    flat: FlatGroup,
    group: dict,
    decoupled: bool,
    factor: float,
    grads: list[torch.Tensor | None],
    found_inf: torch.Tensor | None = None,
) -> None:
    """`flat`'s step (its counts already advanced) as one inductor graph over its tensors;
    drops the gradients. Where `found_inf` (a device flag) is set, nothing changes."""
    live = [i for i, g in enumerate(grads) if g is not None]
    taken = [grads[i] for i in live]
    for p in flat.model:
        p.grad = None
    grads.clear()
    views = flat.views
    pick = lambda name: [views[name][i] for i in live]  # noqa: E731
    beta1, beta2 = group["betas"]
    compiled_adam(
        taken, [local(flat.model[i]) for i in live],
        pick("remainder" if flat.remainders else "master"), pick("exp_avg"), pick("exp_avg_sq"),
        # (`ready`: the counts agree; a view, where an index would copy and sync)
        flat.buffers["step"][:1].expand(len(live)), lr=float(group["lr"]), beta1=beta1, beta2=beta2,
        weight_decay=group["weight_decay"], eps=group["eps"],
        maximize=group.get("maximize", False), decoupled_weight_decay=decoupled, factor=factor,
        found_inf=found_inf, remainders=flat.remainders,
    )  # fmt: skip
