"""How an Adam/AdamW param group steps, by its plan (`containers.update.plan`): torch's own
`adam` (like groups of many inner optimizers in one call), or the chunked driver: for each run
of a group's tensors, decode what is not stored in the kernel's dtype into fp32 scratch, run
torch's fused kernel on the run, and encode back (`compiled`: one inductor graph a tensor).

A tensor is cut at fixed places (multiples of `PAD` elements, or whole rows where a codec
keeps blocks within rows), whatever runs share a kernel call, so results do not depend on what
else the group holds; runs of small tensors share one call. The kernel is elementwise, so a
tensor steps bit for bit as torch's fused step on its decoded values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer
from torch.optim import optimizer as torch_optimizer
from torch.optim.adam import adam

from containers.tensors import local, local_form, scratch, scratch_numel
from containers.update.codecs import MasterCodec, MomentCodec

if TYPE_CHECKING:
    from containers.update.plan import Plan

__all__ = [
    "MOMENTS",
    "PAD",
    "Slot",
    "Update",
    "adams",
    "kernel_skips",
    "plan_in",
    "run",
    "step_adam",
    "step_slots",
    "step_together",
]

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

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
    `found_inf` changes nothing: the kernel leaves the decoded values, which every codec
    encodes back as they were; block codes where they lie in fp32's normal range, and a
    compiled graph keeps the stored codes whatever they hold)."""

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
    live = [_flat_slot(s) for s in live]  # (one view a tensor: a piece is then one slice)
    regions = max(_regions(masters, cast, decode) for cast, decode in plans)
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


def _flat_slot(s: Slot) -> Slot:
    """`s` with its tensors flat (views; coded moments, and a gradient a view cannot
    flatten, as they are: `_grad` copies a run of it at a time)."""
    moments = [m.view(-1) if isinstance(m, torch.Tensor) else m for m in s.moments]
    low = None if s.low is None else s.low.view(-1)
    grad = s.grad.view(-1) if s.grad.is_contiguous() else s.grad
    return Slot(s.value.view(-1), grad, moments, s.step, low, s.index)


def _grad(s: Slot, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of `s`'s gradient."""
    return s.grad[lo:hi] if s.grad.dim() == 1 else s.grad.reshape(-1)[lo:hi]


def _regions(masters: MasterCodec, cast: bool, decode: list[bool]) -> int:
    """Scratch regions a piece takes: its gradient cast, its master decoded, then its moments
    decoded or the master decode's spare regions, whichever are more."""
    return cast + masters.decoded + max(sum(decode), masters.spare)


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
    n_regions = max(_regions(masters, cast, decode) for _, _, _, cast, decode in batch)
    work = scratch(batch[0][0].value.device, stride * max(1, n_regions))
    offsets = [0]
    for _, lo, hi, _, _ in batch:
        offsets.append(offsets[-1] + hi - lo)

    def region(r: int, k: int) -> torch.Tensor:  # piece k's part of region r
        return work[r * stride + offsets[k] : r * stride + offsets[k + 1]]

    # regions in order: the gradient (if cast), the master (if decoded), the moments decoded
    next_region = [0] * len(batch)
    grads, cast_to, cast_from = [], [], []
    for k, (s, lo, hi, cast, _) in enumerate(batch):
        if cast:
            out = region(0, k)
            next_region[k] = 1
            cast_to.append(out)
            cast_from.append(_grad(s, lo, hi))
            grads.append(out)
        else:
            grads.append(_grad(s, lo, hi))
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
        spare = [region(next_region[k], k) for k in range(len(batch))] if masters.spare else []
        masters.decode(pieces, values, spare)  # (the moments' regions: not yet decoded)
    else:
        values = [s.value[lo:hi] for s, lo, hi, _, _ in batch]
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
                column.append(s.moments[m][lo:hi])
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
        masters.encode(values, pieces)
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


# Adam/AdamW groups: torch's `adam`, or the engine.


@functools.cache
def adams() -> tuple[type[Optimizer], ...]:
    """The exact classes whose groups step through `step_adam` (they share torch's `adam`)."""
    from containers.optim.lean_adam import LeanAdam, LeanAdamW  # (they import this module)

    return (torch.optim.Adam, torch.optim.AdamW, LeanAdam, LeanAdamW)


def step_adam(
    plan: Plan | None,
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    has_complex: bool = False,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One Adam/AdamW update of `group` (lists as torch's `_init_group` collects them) by its
    `plan` (None: torch's `adam`); a set `found_inf` no-ops."""
    beta1, beta2 = group["betas"]
    settings = dict(
        amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
        weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
    )  # fmt: skip
    decoupled = group["decoupled_weight_decay"]
    if plan is None or not plan.engine:
        adam(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
            foreach=group["foreach"], capturable=group["capturable"],
            differentiable=group["differentiable"], fused=group["fused"],
            has_complex=has_complex, found_inf=found_inf, decoupled_weight_decay=decoupled,
            **settings,
        )  # fmt: skip
        return
    torch._foreach_add_(steps, 1)
    moments = [exp_avgs, exp_avg_sqs, max_exp_avg_sqs][: 3 if group["amsgrad"] else 2]
    slots = [
        Slot(local(p), local(g), [local_form(m[i]) for m in moments], steps[i])
        for i, (p, g) in enumerate(zip(params, grads))
    ]
    codecs = [(n, plan.moment_codec) for n in MOMENTS[: len(moments)]]
    update = Update(plan.master_codec, codecs, settings, decoupled, found_inf=found_inf)
    run(slots, update, compiled=plan.compiled)
    if found_inf is not None:
        torch._foreach_sub_(steps, [found_inf] * len(steps))


# Many inner optimizers' like groups in one call: bitwise each stepping alone, since these
# kernels compute each tensor from its own gradient, state and step.

HYPERPARAMETERS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "maximize",
    "foreach",
    "fused",
    "capturable",
    "differentiable",
    "decoupled_weight_decay",
)  # what torch's functional `adam` reads: groups agreeing on all of them step in one call

_KEY = itemgetter(*HYPERPARAMETERS)  # one C call per group: this runs on every step
_LR, _FOREACH, _FUSED, _DIFFERENTIABLE = (
    HYPERPARAMETERS.index(k) for k in ("lr", "foreach", "fused", "differentiable")
)


def _mergeable(key: tuple[Any, ...]) -> bool:
    """An explicit fused or foreach kernel, a float lr, not differentiable."""
    return (
        bool(key[_FUSED] or key[_FOREACH])
        and not key[_DIFFERENTIABLE]
        and not isinstance(key[_LR], torch.Tensor)
    )


def _plain(opt: Optimizer) -> bool:
    """A (lean) Adam or AdamW without step hooks or a caller's `GradScaler`."""
    return (
        type(opt) in adams()
        and not opt._optimizer_step_pre_hooks
        and not opt._optimizer_step_post_hooks
        and getattr(opt, "grad_scale", None) is None
        and getattr(opt, "found_inf", None) is None
    )


def _own_step(opt: Optimizer) -> bool:
    """`opt.step` is its class's, or only wrapped by torch's LR scheduler."""
    step = opt.__dict__.get("step")
    return step is None or (
        getattr(step, "_wrapped_by_lr_sched", False)
        and getattr(step, "__wrapped__", None) is type(opt).step
    )


def kernel_skips(optimizers: Sequence[Optimizer]) -> bool:
    """Whether a set `found_inf` changes nothing: all fused, no hooks or `GradScaler`."""
    if torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks:
        return False
    return all(_plain(opt) and all(g["fused"] for g in opt.param_groups) for opt in optimizers)


def plan_in(opt: Optimizer, group: dict[str, Any]) -> Plan | None:
    """The plan `opt` made for `group` when it was added or loaded (None: torch's `adam`)."""
    plans = getattr(opt, "plans", None)
    return plans.get(id(group)) if plans is not None else None


@torch.no_grad()
def step_together(optimizers: Sequence[Optimizer], found_inf: torch.Tensor | None = None) -> None:
    """Step each optimizer once, bitwise as `opt.step()`; a set `found_inf` changes nothing."""
    if torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks:
        for opt in optimizers:
            _step_alone(opt, found_inf)
        return
    buckets: dict[tuple[Any, ...], list[tuple[Optimizer, dict[str, Any]]]] = {}
    for opt in optimizers:
        groups = opt.param_groups
        keys = (
            [_KEY(g) for g in groups]
            if _plain(opt) and _own_step(opt)  # nothing but the update happens in its step()
            else None
        )
        if keys is None or not all(map(_mergeable, keys)):
            _step_alone(opt, found_inf)
            continue
        opt._opt_called = True  # type: ignore[attr-defined]  (what a scheduler's patch notes)
        for key, group in zip(keys, groups):
            buckets.setdefault((*key, plan_in(opt, group)), []).append((opt, group))
    for key, groups in buckets.items():
        _step_bucket(key[-1], groups, found_inf)


def _step_alone(opt: Optimizer, found_inf: torch.Tensor | None) -> None:
    """`opt.step()`, given `found_inf` as a `GradScaler` gives it (torch's step reads it)."""
    if found_inf is None:
        opt.step()
        return
    opt.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        opt.step()
    finally:
        del opt.found_inf  # type: ignore[attr-defined]


def _step_bucket(
    plan: Plan | None,
    groups: list[tuple[Optimizer, dict[str, Any]]],
    found_inf: torch.Tensor | None = None,
) -> None:
    # params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps: as torch's step collects them
    lists: tuple[list[torch.Tensor], ...] = ([], [], [], [], [], [])
    has_complex = False
    for opt, group in groups:
        has_complex |= opt._init_group(group, *lists)  # type: ignore[attr-defined]
    if lists[0]:
        step_adam(plan, groups[0][1], *lists, has_complex=has_complex, found_inf=found_inf)
