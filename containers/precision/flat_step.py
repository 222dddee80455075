"""A flat group's two update paths (`FlatGroup.step`).

Eager (`step_chunks`): each chunk of low-precision gradients cast into fp32 scratch, multiplied
(unscale x clip), stepped by one torch fused Adam/AdamW call on the chunk's flat slices
(remainders joined into the scratch beside it; bf16 moments too, widened, unless torch's kernel
takes them as they are: `FlatGroup.widened`) and written back. On a CPU stepping on few threads
the same bits come from one pass (`step_one_pass`: `containers.optim.cpu_spans`, one call a
group on torch's threads): each storage read and written once in its own dtype. A CPU group
steps so with `compile = true` too: 1.00-1.11x the fp32 fused AdamW step where inductor's graph
took 2.43x (benchmarks/README.md).

Compiled (`step_compiled`, `[mixed_precision] compile = true` or `implementation = "compiled"`,
where the one pass does not step): one inductor graph (`containers.optim.compiled_adam`) over
the group's tensors where they lie: each low-precision gradient read once, its master (or, with
remainders, its bf16 parameter and 16-bit remainder), moments and parameter read and written in
the same pass, the masters and moments as views of the flat buffers. Nothing is gathered or
scattered, no scratch is used, and nothing waits for the host. A few fp32 ulp from the eager
kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from containers.norm import local, scratch
from containers.optim import cpu_adam
from containers.optim.compiled_adam import compiled_adam
from containers.optim.cpu_spans import update_spans
from containers.precision import remainders as rem

if TYPE_CHECKING:
    from containers.precision.flat_adam import FlatGroup

__all__ = ["one_pass", "step_chunks", "step_compiled", "step_one_pass"]


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


def step_chunks(
    flat: FlatGroup,
    group: dict,
    decoupled: bool,
    factor: float,
    grads: list[torch.Tensor | None],
    found_inf: torch.Tensor | None,
) -> None:
    """`FlatGroup.step`'s eager path (its counts already advanced): torch's fused kernel
    over fp32 scratch, chunk by chunk; drops each gradient once it is cast. Where `found_inf`
    is set the kernel changes nothing (masters and moments round-trip exactly)."""
    buf = flat.buffers
    beta1, beta2 = group["betas"]
    update = torch._fused_adamw_ if decoupled else torch._fused_adam_
    step = [buf["step"][0]]
    device = buf["exp_avg"].device
    low = [local(p) for p in flat.model]
    for c, (start, stop, _) in enumerate(flat.chunks):
        n = stop - start
        work = scratch(device, n * flat.regions)
        into = flat.chunk_views(c, work[:n])
        torch._foreach_copy_(into, flat.pieces(c, grads))
        for i in flat.done[c]:
            grads[i] = None
            flat.model[i].grad = None  # cast: the low-precision gradient can go now
        if factor != 1.0:
            work[:n].mul_(factor)
        cast_to = flat.pieces(c, low)
        if flat.remainders:
            master = work[n : 2 * n]
            bits = flat.chunk_views(c, master.view(torch.int32))
            torch._foreach_copy_(bits, [t.view(torch.int16) for t in cast_to])
            rem.join(master.view(torch.int32), buf["remainder"][start:stop])
        else:
            master = buf["master"][start:stop]
        moments = [buf["exp_avg"][start:stop], buf["exp_avg_sq"][start:stop]]
        if flat.widened:
            at = (1 + flat.remainders) * n  # after the gradients (and masters)
            wide = [work[at : at + n], work[at + n : at + 2 * n]]
            torch._foreach_copy_(wide, moments)
            moments, narrow = wide, moments
        update(
            [master], [work[:n]], [moments[0]], [moments[1]], [], step, lr=group["lr"],
            beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
            amsgrad=False, maximize=group.get("maximize", False), found_inf=found_inf,
        )  # fmt: skip
        if flat.widened:
            torch._foreach_copy_(narrow, moments)
        if flat.remainders:
            high = work[:n].view(torch.int32)  # the gradients are spent
            rem.split(master.view(torch.int32), high)
            torch._foreach_copy_([t.view(torch.int16) for t in cast_to], flat.chunk_views(c, high))
            buf["remainder"][start:stop].copy_(master.view(torch.int32))
        else:
            torch._foreach_copy_(cast_to, flat.pieces(c, flat.cast_from))


def step_one_pass(
    lib: cpu_adam.Library,
    flat: FlatGroup,
    group: dict,
    decoupled: bool,
    factor: float,
    grads: list[torch.Tensor | None],
    found_inf: torch.Tensor | None,
) -> None:
    """`step_chunks`' result on a CPU in one pass (`lib`: `one_pass`'s kernel, one call a
    thread: `containers.optim.cpu_spans`): each gradient read where it lies, masters (or
    parameters and remainders) and moments read and written in their own dtypes in the flat
    buffers, no scratch; drops the gradients."""
    buf = flat.buffers
    beta1, beta2 = group["betas"]
    hyper = cpu_adam.settings(
        lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
        eps=group["eps"], step=float(buf["step"][0]), factor=factor,
    )  # fmt: skip
    live = [i for i, g in enumerate(grads) if g is not None]
    kept = "remainder" if flat.remainders else "master"
    update_spans(
        lib, hyper, grads=[grads[i] for i in live], params=[local(flat.model[i]) for i in live],
        starts=[flat.starts[i] for i in live], exp_avg=buf["exp_avg"],
        exp_avg_sq=buf["exp_avg_sq"], **{kept: buf[kept]}, adamw=decoupled,
        maximize=group.get("maximize", False), found_inf=found_inf,
    )  # fmt: skip
    for p in flat.model:
        p.grad = None
    grads.clear()


def one_pass(
    flat: FlatGroup, grads: list[torch.Tensor | None], found_inf: torch.Tensor | None
) -> cpu_adam.Library | None:
    """The kernel for `step_one_pass` if it can step `flat` now (on a CPU, bf16 parameters,
    fp32 or bf16 gradients, every tensor contiguous, the flag (if any) an fp32 value in host
    memory) and is the faster path there (`cpu_adam.kernel`), else None."""
    if flat.buffers["exp_avg"].device.type != "cpu" or flat._low_dtype != torch.bfloat16:
        return None
    if not cpu_adam.readable_flag(found_inf):
        return None
    taken = [g for g in grads if g is not None]
    if not (
        {g.dtype for g in taken} <= {torch.float32, torch.bfloat16}
        and all(map(torch.Tensor.is_contiguous, taken))
        and all(map(torch.Tensor.is_contiguous, map(local, flat.model)))
    ):
        return None
    return cpu_adam.kernel()
