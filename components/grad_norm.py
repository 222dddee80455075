"""Global gradient-norm clipping across all model parts and the ranks of their mesh."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most `max_norm`; return the norm.

    Sharded (DTensor) gradients contribute their shards once: the norm is reduced over the
    mesh, so every rank sees the same global value. All parts must share one mesh (as they do
    here); stages on disjoint ranks would also need a sum over the pipeline group.
    `max_norm = 0` only measures the norm.
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
