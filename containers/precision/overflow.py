"""Whether an Adam/AdamW update could overflow float16 weights, known before it applies.

A master beyond 65504 writes inf into the fp16 model and every later step is non-finite, so
such a step must be skipped before anything changes. By Cauchy-Schwarz, |m_t| <= (1 - b1)
sqrt(sum_k r^k) sqrt(v_t / (1 - b2)) with r = b1^2 / b2 (k < t), so |m_hat / sqrt(v_hat)| <=
`adam_ratio_bound(b1, b2, t)` whatever the gradients (eps only lowers it). A weight after
the step is at most |w| |1 - lr wd| + lr K (decoupled decay; coupled decay is inside the
bound), checked against each group's largest |w|. Other optimizers are not checked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.optim import Optimizer

__all__ = ["adam_ratio_bound", "overflow_refusal"]


def adam_ratio_bound(beta1: float, beta2: float, t: int) -> float:
    """The largest |m_hat / sqrt(v_hat)| Adam's step `t` (from 1) can take, any gradients."""
    r = beta1 * beta1 / beta2
    terms = t if math.isclose(r, 1.0) else (1.0 - r**t) / (1.0 - r)
    ratio = (1.0 - beta1) * math.sqrt(terms / (1.0 - beta2))
    return ratio * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)


def overflow_refusal(
    groups: Sequence[tuple[Optimizer, dict, list[torch.Tensor]]], limit: float
) -> str | None:
    """Why the coming step must not apply, or None; one host sync. `groups`: (optimizer,
    group, local pieces of its low-precision weights); `limit`: the largest finite weight."""
    checked = []
    for opt, group, weights in groups:
        pieces = [w for w in weights if w.numel()]
        if isinstance(opt, torch.optim.Adam | torch.optim.AdamW) and pieces:
            checked.append((opt, group, torch.stack(torch._foreach_norm(pieces, math.inf)).max()))
    if not checked:
        return None
    largest = torch.stack([m.float() for *_, m in checked]).tolist()
    for (opt, group, _), top in zip(checked, largest):
        lr, wd = float(group["lr"]), group["weight_decay"]
        beta1, beta2 = group["betas"]
        first = opt.state.get(group["params"][0], {}).get("step", 0)
        t = int(first) + 1
        decoupled = group.get("decoupled_weight_decay", isinstance(opt, torch.optim.AdamW))
        bound = top * (abs(1.0 - lr * wd) if decoupled else 1.0)
        bound += lr * adam_ratio_bound(beta1, beta2, t)
        if not bound < limit:
            return (
                f"the update could overflow the float16 weights ({type(opt).__name__} at lr "
                f"{lr:.3g}: largest |w| {top:.3g}, after the step up to {bound:.3g} > {limit:g})"
            )
    return None
