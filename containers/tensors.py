"""Tensor helpers every part uses, and the fp32 scratch buffer kept per device."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = [
    "CUDA_SCRATCH_NUMEL",
    "SCRATCH_NUMEL",
    "dense",
    "local",
    "local_form",
    "scratch",
    "scratch_numel",
    "shaped_like",
]

SCRATCH_NUMEL = 1 << 20  # 4 MiB, which low-precision tensors are widened into piecewise
CUDA_SCRATCH_NUMEL = 1 << 24  # 64 MiB on CUDA, where a chunk costs launches, not cache misses

_scratch: dict[torch.device, torch.Tensor] = {}


def scratch_numel(device: torch.device) -> int:
    return CUDA_SCRATCH_NUMEL if device.type == "cuda" else SCRATCH_NUMEL


def scratch(device: torch.device, numel: int) -> torch.Tensor:
    """An fp32 buffer valid until the next call (the kept one if it fits)."""
    kept = scratch_numel(device)
    if numel > kept:
        return torch.empty(numel, dtype=torch.float32, device=device)
    if device not in _scratch:
        _scratch[device] = torch.empty(kept, dtype=torch.float32, device=device)
    return _scratch[device][:numel]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `t` (a DTensor's local shard; a plain tensor as it is)."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_form(stored: Any) -> Any:
    """This rank's piece of a stored form: a tensor, or a dict of tensors (8-bit codes and
    their scales)."""
    return {k: local(v) for k, v in stored.items()} if isinstance(stored, dict) else local(stored)


def shaped_like(view: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`view` (a flat slice) shaped and placed as `like`."""
    view = view.view(local(like).shape)
    if isinstance(like, DTensor):
        return DTensor.from_local(
            view, like.device_mesh, like.placements, shape=like.shape, stride=like.stride(),
            run_check=False,
        )  # fmt: skip
    return view


def dense(grad: torch.Tensor) -> torch.Tensor:
    """The values of a sparse gradient (SparseAdam's embeddings), which norms cannot take."""
    return grad.coalesce().values() if grad.is_sparse else grad
