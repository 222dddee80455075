"""The mixed-precision step of optimizers without flat buffers: gradients cast into fp32
scratch a chunk at a time, smallest tensor first, multiplied (unscale x clip) while in cache,
stepped (a `PER_PARAMETER` optimizer per chunk, any other once) and written back."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim import Optimizer

from containers.state.fsdp1 import ELEMENTWISE
from containers.tensors import SCRATCH_NUMEL, local, scratch, shaped_like

__all__ = ["CHUNK_NUMEL", "PER_PARAMETER", "step_masters", "step_whole"]

# Each chunk costs an optimizer call's Python overhead; larger chunks raise the peak.
CHUNK_NUMEL = SCRATCH_NUMEL
# Exact classes whose update of a parameter reads only its own gradient and state.
PER_PARAMETER = ELEMENTWISE

Triple = tuple[Optimizer, torch.Tensor, torch.Tensor]  # (optimizer, model parameter, master)


def _chunks(triples: list[Triple], limit: int) -> list[list[Triple]]:
    """`triples` smallest first, cut into runs of at most `limit` elements (or one tensor)."""
    runs: list[list[Triple]] = []
    size = 0
    for t in sorted(triples, key=lambda t: local(t[1]).numel()):
        n = local(t[1]).numel()
        if not runs or size + n > limit:
            runs.append([])
            size = 0
        runs[-1].append(t)
        size += n
    return runs


@torch.no_grad()
def step_masters(
    optimizers: Sequence[Optimizer],
    pairs: Sequence[list[tuple[torch.Tensor, torch.Tensor]]],
    factor: float,
    master_dtype: torch.dtype,
    sums: bool = False,
    chunk_numel: int = CHUNK_NUMEL,
) -> None:
    """Cast, multiply by `factor`, step, write back and drop the gradients of `pairs` (per
    optimizer, (model parameter, master) with a gradient; `sums`: step on fp32 sums)."""
    if sums:
        for opt, live in zip(optimizers, pairs):
            if live:
                step_whole(opt, live, factor)
        return
    chunked: list[Triple] = []
    for opt, live in zip(optimizers, pairs):
        if not live:
            continue  # (stepped flat, or no gradient)
        if type(opt) in PER_PARAMETER and not any(p.grad.is_sparse for p, _ in live):
            chunked.extend((opt, p, m) for p, m in live)
        else:
            step_whole(opt, live, factor)
    for run in _chunks(chunked, chunk_numel):
        numel = sum(local(m).numel() for _, _, m in run)
        if master_dtype == torch.float32:
            buffer = scratch(local(run[0][2]).device, numel)
        else:
            buffer = torch.empty(numel, dtype=master_dtype, device=local(run[0][2]).device)
        views = list(torch.split(buffer, [local(m).numel() for _, _, m in run]))
        grads = [local(p.grad).reshape(-1) for _, p, _ in run]
        torch._foreach_copy_(views, grads)
        del grads
        for _, p, _ in run:
            p.grad = None  # cast: drop the low-precision gradient
        if factor != 1.0:
            torch._foreach_mul_(views, factor)
        for (_, _, m), view in zip(run, views):
            m.grad = shaped_like(view, m)
        for opt in dict.fromkeys(opt for opt, _, _ in run):
            opt.step()
        for _, _, m in run:
            m.grad = None
        torch._foreach_copy_([local(p) for _, p, _ in run], [local(m) for _, _, m in run])


def step_whole(
    opt: Optimizer, live: list[tuple[torch.Tensor, torch.Tensor]], factor: float
) -> None:
    """One step of any `opt` for all its `live` (model parameter, master) pairs."""
    for p, m in live:
        if m.grad is None:
            m.grad = p.grad.to(m.dtype)
        p.grad = None
    if factor != 1.0 and live:
        torch._foreach_mul_([local(m.grad) for _, m in live], factor)
    opt.step()
    for _, m in live:
        m.grad = None
    if live:
        torch._foreach_copy_([local(p) for p, _ in live], [local(m) for _, m in live])
