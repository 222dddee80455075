"""The eager mixed-precision step of optimizers without flat buffers
(`containers.precision.flat_adam` takes fused Adam/AdamW groups): low-precision gradients to
fp32, chunk by chunk.

`MasterWeights.apply` steps fp32 masters with the inner optimizers, which need fp32 gradients.
Casting every gradient at once
would add 4 bytes/param at the step's peak; casting per tensor allocates (and page-faults) a
fresh fp32 tensor each time, which on a CPU costs more than the cast. So the gradients are cast
in chunks of about `CHUNK_NUMEL` elements into the fp32 scratch buffer that
`containers.tensors.scratch` keeps between steps (the norm pass uses it too), with one
`torch._foreach_copy_` per chunk, unscaled and clipped there with one `torch._foreach_mul_`
while the chunk is in cache, stepped, and written back to the model parameters; each
low-precision gradient is dropped as soon as it is cast. A tensor larger than a chunk gets a
buffer of its own; chunks go from the smallest tensors to the largest, so by then the dropped
gradients have paid for it. The step's peak is the steady parameters + gradients + masters +
state plus the 4 MiB buffer.

An inner optimizer then steps once per chunk it has parameters in, with only that chunk's
masters holding gradients (torch optimizers skip parameters without one). That is the same
update only for optimizers whose update of a parameter reads nothing but that parameter's own
gradient and state: `PER_PARAMETER` lists torch's. Any other optimizer (a subclass, LBFGS,
SparseAdam, one of the user's) steps once, over fp32 copies of all its gradients, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.optim import Optimizer

from containers.state.fsdp1 import ELEMENTWISE
from containers.tensors import SCRATCH_NUMEL, local, scratch, shaped_like

__all__ = ["CHUNK_NUMEL", "PER_PARAMETER", "step_masters", "step_whole"]

CHUNK_NUMEL = SCRATCH_NUMEL
"""Elements cast per chunk, into the fp32 scratch buffer kept between steps (4 MiB). An inner
optimizer's step costs ~0.2 ms of Python per call, so chunks must not be many (2^18 was slower
on the benchmark's 8.5M parameters: 40 chunks); larger chunks raise the peak."""

PER_PARAMETER = ELEMENTWISE
"""Optimizers (the exact classes) whose update of a parameter reads only that parameter's
gradient and state, so stepping their parameters chunk by chunk is one step."""

Triple = tuple[Optimizer, torch.Tensor, torch.Tensor]  # (optimizer, model parameter, master)


def _chunks(triples: list[Triple], limit: int) -> list[list[Triple]]:
    """`triples` from the smallest gradient to the largest, cut into runs of at most `limit`
    elements (a larger tensor is a run of its own)."""
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
    sums: dict[torch.Tensor, torch.Tensor] | None = None,
    chunk_numel: int = CHUNK_NUMEL,
) -> None:
    """Step `optimizers` (each with its (model parameter, master) `pairs` that have a
    gradient): cast, multiply by `factor` (unscale x clip), step, write back, drop gradients.
    `sums`: parameter -> its fp32 gradient sum (`containers.precision.sums`), which its master
    steps on instead of the rounded gradient (taken out as it is used)."""
    if sums is not None:
        for opt, live in zip(optimizers, pairs):
            if live:
                step_whole(opt, live, factor, _from(sums))
        return
    chunked: list[Triple] = []
    for opt, live in zip(optimizers, pairs):
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
            p.grad = None  # cast: the low-precision gradient can go now
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
    opt: Optimizer,
    live: list[tuple[torch.Tensor, torch.Tensor]],
    factor: float,
    grad_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """One step of `opt` over full-precision gradients of all its (model parameter, master)
    pairs `live` (any optimizer): `grad_of(p, m)` gives the master's gradient (default: the
    parameter's, cast to the master's dtype); the low-precision gradients are dropped."""
    for p, m in live:
        m.grad = grad_of(p, m) if grad_of is not None else p.grad.to(m.dtype)
        p.grad = None
    if factor != 1.0 and live:
        torch._foreach_mul_([local(m.grad) for _, m in live], factor)
    opt.step()
    for _, m in live:
        m.grad = None
    if live:
        torch._foreach_copy_([local(p) for p, _ in live], [local(m) for _, m in live])


def _from(
    sums: dict[torch.Tensor, torch.Tensor],
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`step_whole`'s `grad_of` for fp32 sums: a parameter's sum, or, for a gradient set by
    hand (not summed), its cast."""

    def grad_of(p: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        total = sums.pop(p, None)
        return shaped_like(total if total is not None else local(p.grad).to(m.dtype), m)

    return grad_of
