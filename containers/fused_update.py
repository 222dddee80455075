"""One-pass AdamW update for mixed precision, fused with `torch.compile`.

Reads the low-precision gradient once and writes the fp32 master, both moments and the
low-precision parameter in the same pass (the eager path makes five passes). Compiling takes
tens of seconds once per process, so it is opt-in; the eager path stays for tests and short
runs. The optimizer state keeps torch's AdamW layout (`step`, `exp_avg`, `exp_avg_sq`), so
checkpoints are the same either way.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch.optim import Optimizer

__all__ = ["fused_adamw_step", "supports_fused_update"]


def _update(
    p: torch.Tensor,
    g: torch.Tensor,
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    s: torch.Tensor,
) -> None:
    # s = [grad factor, 1 - lr * wd, 1 - beta1, beta2, 1 - beta2, sqrt(bias corr. 2), eps,
    #      -lr / bias corr. 1]; a tensor, so changing lr never recompiles.
    grad = g.float() * s[0]
    master.mul_(s[1])
    exp_avg.lerp_(grad, s[2])
    exp_avg_sq.copy_(exp_avg_sq * s[3] + grad * grad * s[4])
    master.add_(exp_avg / (exp_avg_sq.sqrt() / s[5] + s[6]) * s[7])
    p.copy_(master)


def _square_sum(g: torch.Tensor) -> torch.Tensor:
    x = g.float()
    return (x * x).sum()


@functools.cache
def compiled() -> tuple[Callable, Callable]:
    """The compiled update and sum-of-squares kernels (compiled on first use)."""
    return (
        torch.compile(_update, dynamic=True, fullgraph=True),
        torch.compile(_square_sum, dynamic=True, fullgraph=True),
    )


def supports_fused_update(opt: Optimizer) -> bool:
    """Plain AdamW (or Adam without weight decay): the math `_update` implements."""
    if type(opt) not in (torch.optim.AdamW, torch.optim.Adam):
        return False
    for g in opt.param_groups:
        if g.get("amsgrad") or g.get("maximize") or g.get("differentiable"):
            return False
        if type(opt) is torch.optim.Adam and g["weight_decay"] != 0:
            return False
    return True


@torch.no_grad()
def fused_adamw_step(
    opt: Optimizer,
    pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    factor: float,
) -> None:
    """Step `opt` over (param local, grad local, master) triples in one pass each."""
    update, _ = compiled()
    group_of = {id(m): g for g in opt.param_groups for m in g["params"]}
    for p, grad, master in pairs:
        group = group_of[id(master)]
        state = opt.state[master]
        local = master.to_local() if hasattr(master, "to_local") else master
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        state["step"] += 1
        step = state["step"].item()
        lr, (beta1, beta2) = float(group["lr"]), group["betas"]
        wd = group["weight_decay"] if type(opt) is torch.optim.AdamW else 0.0
        scalars = torch.tensor(
            [
                factor,
                1 - lr * wd,
                1 - beta1,
                beta2,
                1 - beta2,
                math.sqrt(1 - beta2**step),
                group["eps"],
                -lr / (1 - beta1**step),
            ],
            dtype=torch.float32,
            device=local.device,
        )
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        if hasattr(exp_avg, "to_local"):
            exp_avg, exp_avg_sq = exp_avg.to_local(), exp_avg_sq.to_local()
        update(p, grad, local, exp_avg, exp_avg_sq, scalars)
