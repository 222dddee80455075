"""Adam/AdamW as one inductor graph over a group's tensors, each in its own dtype.

Torch's fused kernels need moments in the parameters' dtype, so lean state would step through
fp32 copies; here each tensor is read and written once, the arithmetic in fp32, with no host
sync (hyperparameters reach the device in one non-blocking copy, a skip is the device flag
`found_inf`). Results are a few fp32 ulp from torch's fused kernel (another rounding order).
Tensors enter as flat views so dynamo does not specialize on shapes; on CPU, for tests only.
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
"""Graphs `_adam` may have (torch's default of 8 is too few for a model's groups or units)."""


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
    """One Adam/AdamW update of contiguous local tensors.

    Args:
        params: low-precision parameters written from the masters (None: `masters` are the
            parameters).
        steps: one step count per tensor, already advanced.
        remainders: `masters` are the int16 remainders completing bf16 `params`.
        settings: as `_on_device` takes them (`factor` multiplies the gradients; a set
            `found_inf` skips).
    """
    hyper, corrections = _on_device(steps, **settings)
    # Flat views, never Parameters (dynamo makes their shapes static).
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
    """Whether `compiled_coded_adam` takes a parameter: contiguous, rows of whole blocks."""
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
    """`compiled_adam` over 8-bit `codes` (per parameter: m code, m scale, v code, v top).

    A code may differ from the eager path's where a value is within ulps of a threshold."""
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
    """`t` with its row length (BLOCK or 1) static, so inductor reduces a block in place."""
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
    """`_adam` over (n, BLOCK) views of 8-bit codes, their scales (n, 1)."""
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
    """Shared hyperparameters `h` (skip flag last) and per-tensor bias corrections `c`,
    made on the device without a host sync."""
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
    """Adam/AdamW per tensor in one graph; `h` and `c` are tensors so no value recompiles."""
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
    """One tensor's fp32 update: the new master and moments, before the skip."""
    g = grad.float() * h[0] + value * h[2]
    avg = exp_avg.lerp(g, h[3])
    avg_sq = exp_avg_sq * h[4] + g * g * h[5]
    return value * h[1] - c[0] * avg / (avg_sq.sqrt() / c[1] + h[6]), avg, avg_sq


@functools.cache
def _recompiles() -> contextlib.AbstractContextManager:
    """`recompile_limit` raised to `RECOMPILES` for our graphs only; cached because `patch`
    builds a class each call."""
    return torch._dynamo.config.patch(recompile_limit=RECOMPILES)


@functools.cache
def _compiled() -> Callable[..., None]:
    """`_adam`, compiled on first use."""
    return _compile(_adam)


@functools.cache
def _compiled_coded() -> Callable[..., None]:
    """`_coded_adam`, compiled on first use."""
    return _compile(_coded_adam)


def _compile(fn: Callable[..., None]) -> Callable[..., None]:
    """`fn` as one graph; inductor's size asserts off (dynamo's guards check the sizes)."""
    return torch.compile(fn, dynamic=True, fullgraph=True, options={"size_asserts": False})
