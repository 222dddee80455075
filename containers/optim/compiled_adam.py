"""Adam/AdamW as one inductor graph over a group's tensors (`compiled_adam`).

Torch's fused kernels take the moments in the parameters' dtype only, so lean state (bf16
moments, or masters kept as bf16 parameters plus remainders) steps there through fp32 copies:
~52 bytes a parameter moved where the update needs 20. Here the update is one `torch.compile`d
function (`_adam`) over the group's tensors where they lie: each gradient, parameter and
moment read once and written once in its own dtype, the arithmetic in fp32. Nothing waits
for the host: the hyperparameters reach the device in one non-blocking copy, the bias
corrections come from the device's step counts (in fp64, as torch's kernels take them), and a
skip is a device flag (torch's `found_inf`), where every tensor keeps its value. A few fp32 ulp
from torch's fused kernel (another order of roundings), not bitwise. On an H200 the mixed-
precision graph alone is 0.92x a fused fp32 AdamW step. On a CPU it is for tests: inductor
tiles a loop that mixes fp32 and bf16 tensors at the fp32 vector width (an fp32 tensor updated
in place always does), so on AVX-512 each bf16 load and store is a masked half vector (on an
AMD Zen 4, 2.4x the time of the same graph over fp32 moments), and on AVX2 its bf16
conversions are slow (benchmarks/README.md, `bench_lean_state.py --graphs`).

The host's part runs every step: inductor's size and stride asserts are off (dynamo's guards
have checked them). The tensors enter as flat views (~0.9 us each): passed as they are, the
parameters among them make dynamo specialize on their shapes (measured: 29 graphs instead of
20 for the suite's compiled tests, +12-23 s cold).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from containers.optim.moment_codes import (
    BLOCK,
    log_codes,
    log_tables,
    log_values,
    signed_codes,
    signed_values,
)

__all__ = ["RECOMPILES", "compiled_adam", "compiled_coded_adam", "takes_codes"]

RECOMPILES = 64
"""Graphs `_adam` may have (torch's default limit per function is 8; a model's groups, or its
in-backward units, can differ in more ways than that)."""


@torch.no_grad()
def compiled_adam(
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor] | None,
    masters: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: torch.Tensor,
    *,
    remainders: bool = False,
    **settings: Any,
) -> None:
    """One Adam/AdamW update of contiguous local tensors, their step counts `steps` (one per
    tensor, already advanced), `settings` as `_on_device` takes them (the gradients are
    multiplied by `factor`: unscale, clip; a set `found_inf` skips). `params`: low-precision
    parameters written from the masters (None: `masters` are the parameters); with
    `remainders`, `masters` are the int16 remainders that complete the bf16 `params`
    (`containers.precision.remainders`)."""
    hyper, corrections = _on_device(steps, **settings)
    # Flat views: a graph per number of tensors and dtypes (and sizes that repeat), whatever
    # their shapes, so that groups and models of other shapes share it; and never a Parameter
    # (dynamo makes a parameter's shape static: a graph per model).
    flat = lambda ts: [t.view(-1) for t in ts]  # noqa: E731
    with _recompiles():
        _compiled()(
            [g.reshape(-1) for g in grads],
            flat(params) if params is not None else None,
            flat(masters),
            flat(exp_avgs),
            flat(exp_avg_sqs),
            hyper,
            corrections,
            remainders,
        )


def takes_codes(p: torch.Tensor, g: torch.Tensor, codes: Sequence[torch.Tensor]) -> bool:
    """Whether `compiled_coded_adam` takes a parameter (local tensors): contiguous, with
    rows of whole blocks, so its flat blocks are the codes' own."""
    return (
        p.dim() > 0 and p.shape[-1] % BLOCK == 0 and all(t.is_contiguous() for t in (p, g, *codes))
    )


@torch.no_grad()
def compiled_coded_adam(
    grads: Sequence[torch.Tensor],
    masters: Sequence[torch.Tensor],
    codes: Sequence[Sequence[torch.Tensor]],
    steps: torch.Tensor,
    **settings: Any,
) -> None:
    """`compiled_adam` over 8-bit moments (`containers.optim.coded_adam`'s codes: each
    parameter's exp_avg code and scale, exp_avg_sq code and block maximum) of parameters
    that `takes_codes`: decoded, updated and encoded again in one graph, each code read and
    written once. The codes are those of the moments the graph computes, a few fp32 ulp from
    torch's kernel's (a code may differ where a value lies that close to a threshold)."""
    hyper, corrections = _on_device(steps, **settings)
    blocks = lambda ts, n=BLOCK: [_static_rows(t.view(-1, n)) for t in ts]  # noqa: E731
    values, thresholds = log_tables(steps.device)
    with _recompiles():
        _compiled_coded()(
            blocks(g.reshape(-1) for g in grads),
            blocks(masters),
            *(blocks((c[k] for c in codes), BLOCK if k % 2 == 0 else 1) for k in range(4)),
            hyper,
            corrections,
            values,
            thresholds,
        )


def _static_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` with its row length (BLOCK or 1) known to the graph: under `dynamic=True` it would
    be symbolic, and inductor could not reduce a block of known size where it lies (on a GPU,
    in registers; unmeasured there: the H100's 1.91x was with it symbolic)."""
    torch._dynamo.mark_static(t, 1)
    return t


def _coded_adam(
    grads: list[torch.Tensor],
    masters: list[torch.Tensor],
    m_codes: list[torch.Tensor],
    m_scales: list[torch.Tensor],
    v_codes: list[torch.Tensor],
    v_tops: list[torch.Tensor],
    h: torch.Tensor,
    c: torch.Tensor,
    values: torch.Tensor,
    thresholds: torch.Tensor,
) -> None:
    """`_adam` over blocks of 8-bit moments (see `compiled_coded_adam`): (n, BLOCK) views,
    the scales (n, 1)."""
    skip = h[7] > 0
    for i, (grad, master) in enumerate(zip(grads, masters)):
        value = master.float()
        avg = signed_values(m_codes[i], m_scales[i])
        avg_sq = log_values(v_codes[i], v_tops[i], values)
        new, avg, avg_sq = _update(grad, value, avg, avg_sq, h, c[i])
        m, scale = signed_codes(avg)
        v, top = log_codes(avg_sq, thresholds)
        m_codes[i].copy_(torch.where(skip, m_codes[i], m.to(torch.int8)))
        m_scales[i].copy_(torch.where(skip, m_scales[i], scale))
        v_codes[i].copy_(torch.where(skip, v_codes[i], v))
        v_tops[i].copy_(torch.where(skip, v_tops[i], top))
        master.copy_(torch.where(skip, value, new))


def _on_device(
    steps: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    decoupled_weight_decay: bool,
    factor: float = 1.0,
    found_inf: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The graph's shared hyperparameters `h` (the skip flag last) and each tensor's bias
    corrections `c` (`steps`: one count a tensor), on the device without a host sync."""
    values = torch.tensor(
        [
            factor * (-1.0 if maximize else 1.0),
            1.0 - lr * weight_decay if decoupled_weight_decay else 1.0,  # a multiply
            0.0 if decoupled_weight_decay else weight_decay,  # L2: added to the gradient
            1.0 - beta1,
            beta2,
            1.0 - beta2,
            eps,
            lr,
            beta1,
        ],
        dtype=torch.float64,
    )
    if steps.device.type != "cpu":  # pinned, so the copy does not wait for the device
        values = values.pin_memory()
    values = values.to(steps.device, non_blocking=True)
    counts = steps.double()
    skip = found_inf.double().view(1) if found_inf is not None else counts.new_zeros(1)
    hyper = torch.cat([values[:7], skip]).float()
    # Per tensor: lr / (1 - beta1^t) and sqrt(1 - beta2^t).
    corrections = torch.stack(
        [values[7] / (1.0 - values[8].pow(counts)), (1.0 - values[4].pow(counts)).sqrt()], 1
    ).float()
    return hyper, corrections


def _adam(
    grads: list[torch.Tensor],
    params: list[torch.Tensor] | None,
    masters: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    h: torch.Tensor,
    c: torch.Tensor,
    remainders: bool,
) -> None:
    """Adam/AdamW, tensor by tensor, in one graph (see `compiled_adam`): `h` the shared
    hyperparameters, `c` each tensor's bias corrections, tensors so that no value
    recompiles. torch's fused kernel's operations in another order of roundings."""
    skip = h[7] > 0  # a skipped step writes back what it read
    for i, (grad, master, exp_avg, exp_avg_sq) in enumerate(
        zip(grads, masters, exp_avgs, exp_avg_sqs)
    ):
        param = params[i] if params is not None else None
        if remainders:  # the master: the bf16 bits above, the remainder below
            high = param.view(torch.int16).to(torch.int32)
            value = (high * 65536 + master.to(torch.int32)).view(torch.float32)
        else:
            value = master.float()
        new, avg, avg_sq = _update(grad, value, exp_avg.float(), exp_avg_sq.float(), h, c[i])
        exp_avg.copy_(torch.where(skip, exp_avg.float(), avg))
        exp_avg_sq.copy_(torch.where(skip, exp_avg_sq.float(), avg_sq))
        new = torch.where(skip, value, new)
        if remainders:  # + half a bf16 ulp (remainders.HALF_ULP): round half away from zero
            bits = new.view(torch.int32)
            high = (bits + 0x8000) >> 16
            master.copy_(bits - high * 65536)
            param.copy_(high.to(torch.int16).view(torch.bfloat16))
        else:
            master.copy_(new)
            if param is not None:
                param.copy_(torch.where(skip, param, new.to(param.dtype)))


def _update(
    grad: torch.Tensor,
    value: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    h: torch.Tensor,
    c: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tensor's Adam/AdamW update in fp32 (`value` the master, the moments widened): the
    new master and moments, before the skip."""
    g = grad.float() * h[0] + value * h[2]
    avg = exp_avg.lerp(g, h[3])
    avg_sq = exp_avg_sq * h[4] + g * g * h[5]
    return value * h[1] - c[0] * avg / (avg_sq.sqrt() / c[1] + h[6]), avg, avg_sq


@functools.cache
def _recompiles() -> contextlib.AbstractContextManager:
    """`recompile_limit` raised to `RECOMPILES` while our graph runs (and compiles), not for the
    user's own; made once (`patch` builds a class each call)."""
    return torch._dynamo.config.patch(recompile_limit=RECOMPILES)


@functools.cache
def _compiled() -> Callable[..., None]:
    """`_adam` compiled on first use (seconds to minutes once, then inductor's cache)."""
    return _compile(_adam)


@functools.cache
def _compiled_coded() -> Callable[..., None]:
    """`_coded_adam` compiled on first use."""
    return _compile(_coded_adam)


def _compile(fn: Callable[..., None]) -> Callable[..., None]:
    return torch.compile(fn, dynamic=True, fullgraph=True, options={"size_asserts": False})
