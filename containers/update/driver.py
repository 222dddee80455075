"""The one driver of an Adam/AdamW update: for each run of a group's tensors, decode what is
not stored in the kernel's dtype into fp32 scratch, run torch's fused kernel on the run, and
encode back.

A tensor is cut at fixed places (multiples of `PAD` elements, or whole rows where a codec
keeps blocks within rows), whatever runs share a kernel call, so results do not depend on what
else the group holds; runs of small tensors share one call. The kernel is elementwise, so a
tensor steps bit for bit as torch's fused step on its decoded values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from containers.tensors import scratch, scratch_numel
from containers.update.masters import MasterCodec
from containers.update.moments import MomentCodec

__all__ = ["PAD", "Slot", "Update", "run", "step_slots"]

PAD = 64  # a multiple of every CPU vector width and of the fused kernel's per-thread split


@dataclass
class Slot:
    """One tensor of a group, local pieces: what the kernel steps (`value`: the parameter,
    its fp32 master, or its remainder), the model's parameter written from it (`low`), the
    gradient, the stored moments (in the group's codecs) and the step count (advanced)."""

    value: torch.Tensor
    grad: torch.Tensor
    moments: Sequence[Any]
    step: torch.Tensor
    low: torch.Tensor | None = None
    index: int = 0  # reported to `release` once its gradient is spent


@dataclass(frozen=True)
class Update:
    """What one update applies to every slot of a group: what `value` is (`masters`), each
    moment's name and codec in the kernel's order (exp_avg, exp_avg_sq, max_exp_avg_sq), the
    kernel's hyperparameters (lr, beta1, beta2, weight_decay, eps, amsgrad, maximize), AdamW's
    decoupled decay or Adam's, a gradient multiplier (unscale x clip), and a skip flag (a set
    `found_inf` changes nothing: every codec round-trips exactly)."""

    masters: MasterCodec
    codecs: Sequence[tuple[str, MomentCodec]]
    settings: dict[str, Any]
    decoupled: bool
    factor: float = 1.0
    found_inf: torch.Tensor | None = None


def _cuts(numel: int, unit: int, limit: int) -> list[tuple[int, int]]:
    """[lo, hi) runs of `numel` elements, each at most `limit` (at least one `unit`), cut at
    multiples of `unit`."""
    size = max(unit, limit // unit * unit)
    return [(lo, min(lo + size, numel)) for lo in range(0, numel, size)]


@torch.no_grad()
def step_slots(
    slots: Sequence[Slot],
    update: Update,
    release: Callable[[int], None] | None = None,
    budget: int | None = None,
) -> None:
    """`update` of `slots` (their step counts advanced), a run of pieces at a time.

    Args:
        release: called with a slot's `index` once its gradient is read (cast or stepped).
        budget: fp32 scratch elements (default: the device's scratch).
    """
    masters, codecs, factor = update.masters, update.codecs, update.factor
    live = [s for s in slots if s.value.numel()]
    if not live:
        return
    device = live[0].value.device
    kernel = torch._fused_adamw_ if update.decoupled else torch._fused_adam_
    hyper = {**update.settings, "grad_scale": None, "found_inf": update.found_inf}
    dtype_of = (lambda s: torch.float32) if masters.decoded else (lambda s: s.value.dtype)
    # per slot: cast its gradient? decode which moments?
    plans = []
    for s in live:
        dtype = dtype_of(s)
        cast = masters.decoded or factor != 1.0 or s.grad.dtype != dtype
        decode = [not c.direct(m, dtype) for (_, c), m in zip(codecs, s.moments)]
        plans.append((cast, decode))
    regions = max(cast + masters.decoded + sum(decode) for cast, decode in plans)
    total = budget if budget is not None else scratch_numel(device)
    limit = total // max(1, regions)
    batch: list[tuple[Slot, int, int, bool, list[bool]]] = []
    filled = 0

    def flush() -> None:
        nonlocal filled
        if batch:
            _run(batch, max(limit, filled), kernel, hyper, update, release)
        batch.clear()
        filled = 0

    for s, (cast, decode) in zip(live, plans):
        row = max([1] + [c.row(m) for (_, c), m in zip(codecs, s.moments)])
        unit = row if row > 1 else PAD
        for lo, hi in _cuts(s.value.numel(), unit, limit):
            if batch and (filled + hi - lo > limit or batch[-1][0].value.dtype != s.value.dtype):
                flush()
            batch.append((s, lo, hi, cast, decode))
            filled += hi - lo
    flush()


def _run(
    batch: list[tuple[Slot, int, int, bool, list[bool]]],
    stride: int,
    kernel: Callable[..., None],
    hyper: dict[str, Any],
    update: Update,
    release: Callable[[int], None] | None,
) -> None:
    """Decode, step and encode one batch of pieces; region r of scratch is [r * stride, ...)."""
    masters, codecs, factor = update.masters, update.codecs, update.factor
    n_regions = max(cast + masters.decoded + sum(decode) for _, _, _, cast, decode in batch)
    work = scratch(batch[0][0].value.device, stride * max(1, n_regions))
    offsets = [0]
    for _, lo, hi, _, _ in batch:
        offsets.append(offsets[-1] + hi - lo)

    def region(r: int, k: int) -> torch.Tensor:  # piece k's part of region r
        return work[r * stride + offsets[k] : r * stride + offsets[k + 1]]

    def flat(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:  # (a view: written in place)
        return t.view(-1)[lo:hi]

    # regions in order: the gradient (if cast), the master (if decoded), the moments decoded
    next_region = [0] * len(batch)
    grads, cast_to, cast_from = [], [], []
    for k, (s, lo, hi, cast, _) in enumerate(batch):
        if cast:
            out = region(0, k)
            next_region[k] = 1
            cast_to.append(out)
            cast_from.append(s.grad.reshape(-1)[lo:hi])
            grads.append(out)
        else:
            grads.append(s.grad.reshape(-1)[lo:hi])
    if cast_to:
        torch._foreach_copy_(cast_to, cast_from)
        if factor != 1.0:
            torch._foreach_mul_(cast_to, factor)
    del cast_from
    if release is not None:
        for s, _, hi, cast, _ in batch:
            if hi == s.value.numel() and cast:
                release(s.index)
    pieces = [(s.value, s.low, lo, hi) for s, lo, hi, _, _ in batch]
    if masters.decoded:
        values = [region(next_region[k], k) for k in range(len(batch))]
        next_region = [r + 1 for r in next_region]
        masters.decode(pieces, values)
    else:
        values = [flat(s.value, lo, hi) for s, lo, hi, _, _ in batch]
    moments: list[list[torch.Tensor]] = []
    coded: list[tuple[str, MomentCodec, list, list]] = []
    for m, (name, codec) in enumerate(codecs):
        column, outs, stored = [], [], []
        for k, (s, lo, hi, _, decode) in enumerate(batch):
            if decode[m]:
                out = region(next_region[k], k)
                next_region[k] += 1
                column.append(out)
                outs.append(out)
                stored.append((s.moments[m], lo, hi))
            else:
                column.append(flat(s.moments[m], lo, hi))
        if outs:
            codec.decode(name, stored, outs)
            coded.append((name, codec, outs, stored))
        moments.append(column)
    steps = [s.step for s, *_ in batch]
    third = moments[2] if len(moments) > 2 else []
    kernel(values, grads, moments[0], moments[1], third, steps, **hyper)
    for name, codec, outs, stored in coded:
        codec.encode(name, outs, stored)
    if masters.decoded:
        masters.encode(values, pieces, grads)  # the gradients are spent: scratch to use
    else:
        masters.written([p for p in pieces if p[1] is not None])
    if release is not None:
        for s, _, hi, cast, _ in batch:
            if hi == s.value.numel() and not cast:
                release(s.index)


def run(
    slots: Sequence[Slot],
    update: Update,
    *,
    compiled: bool = False,
    release: Callable[[int], None] | None = None,
    budget: int | None = None,
) -> None:
    """`update` of `slots`: in graphs where `compiled` and a graph takes a tensor
    (`containers.update.compiled`), the rest chunked (`step_slots`)."""
    if compiled:
        from containers.update.compiled import step_compiled  # (it imports this module)

        slots = step_compiled(slots, update)
    step_slots(slots, update, release, budget)
