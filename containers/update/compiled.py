"""The compiled driver: a tensor's decode, Adam/AdamW update and encode as one inductor graph
over its stored forms, each read and written once, no fp32 scratch and no host sync
(hyperparameters reach the device in one non-blocking copy; a skip is the device flag).

One graph per kind of tensor (the codecs and dtypes), not per group: tensors enter as views
with dynamic sizes (`_parts`), so a model's tensors share a few graphs, as torchao's low-bit
optimizers compile one update per parameter. Results are a few fp32 ulp from the chunked
driver (another rounding order). What a codec cannot take in a graph (codes whose rows are
not whole blocks) steps through the chunked driver.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from containers.tensors import scratch_numel
from containers.update.codecs import BLOCK
from containers.update.driver import Slot, Update
from containers.update.forms import MASTER_CODECS, MOMENT_CODECS

__all__ = ["RECOMPILES", "step_compiled"]

RECOMPILES = 64
"""Graphs the update may have (torch's default of 8 is too few for every kind of tensor)."""


def _parts(s: Slot, limit: int) -> Iterator[tuple[Any, ...]]:
    """A slot's gradient, value, parameter and moments, as the graph takes them: dense ones
    whole, as one row; coded ones as (blocks, BLOCK) rows, so the update and the blocks' maxima
    are one loop nest (a flat view's index arithmetic divides each element), in runs of about
    `limit` elements (at least 2 rows; the last up to twice that), so a CPU's intermediates
    stay in cache, not in fresh pages."""
    rows = s.value.numel() // BLOCK if isinstance(s.moments[0], dict) else 1

    def view(t: Any) -> Any:  # views of what the graph writes (never Parameters: dynamo
        if isinstance(t, dict):  # makes their shapes static)
            return {k: v.view(rows, -1) for k, v in t.items()}
        return t.view(rows, -1) if t is not None else None

    whole = [s.grad.reshape(rows, -1), view(s.value), view(s.low)], [view(m) for m in s.moments]
    step = max(2, limit // BLOCK)  # (a run of one row would compile a graph of its own)
    lo = 0
    while lo < rows:
        hi = rows if rows - lo < 2 * step else lo + step
        run = slice(lo, hi)
        tensors = [t[run] if t is not None else None for t in whole[0]]
        moments = [{k: v[run] for k, v in m.items()} if isinstance(m, dict) else m[run]
                   for m in whole[1]]  # fmt: skip
        yield *tensors, moments
        lo = hi


@torch.no_grad()
def step_compiled(slots: Sequence[Slot], update: Update) -> list[Slot]:
    """`update` of the `slots` a graph takes (counts advanced); return the others, for the
    chunked driver."""
    masters, codecs = update.masters, update.codecs
    taken, rest = [], []
    for s in slots:
        fits = s.value.is_contiguous() and all(c.graphs(m) for (_, c), m in zip(codecs, s.moments))
        (taken if fits and s.value.numel() else rest).append(s)
    if not taken:
        return rest
    steps = torch.stack([s.step for s in taken])
    hyper, corrections = _on_device(steps, update)
    device = taken[0].value.device
    consts = tuple(c.constants(device) for _, c in codecs)
    names = tuple(name for name, _ in codecs)
    kinds = (masters.name, *(c.name for _, c in codecs))
    graph = _graph()
    limit = scratch_numel(device)
    with _recompiles():
        for s, c in zip(taken, corrections):
            for part in _parts(s, limit):
                graph(*part, hyper, c, kinds, names, consts)
    return rest


def _update_one(
    grad: torch.Tensor,
    value: torch.Tensor,
    low: torch.Tensor | None,
    moments: list[Any],
    h: torch.Tensor,
    c: torch.Tensor,
    kinds: tuple[str, ...],
    names: tuple[str, ...],
    consts: tuple[tuple[torch.Tensor, ...], ...],
) -> None:
    """One tensor's update; `h` and `c` are tensors so no value recompiles."""
    skip = h[7] > 0  # a skipped step writes back what it read
    master, codecs = MASTER_CODECS[kinds[0]], [MOMENT_CODECS[k] for k in kinds[1:]]
    x = master.values(value, low)
    m, v = (codec.values(n, s, k) for codec, n, s, k in zip(codecs, names, moments, consts))
    g = grad.float() * h[0] + x * h[2]
    m = m.lerp(g, h[3])
    v = v * h[4] + g * g * h[5]
    new = x * h[1] - c[0] * m / (v.sqrt() / c[1] + h[6])
    for codec, n, s, k, t in zip(codecs, names, moments, consts, (m, v)):
        codec.store(n, s, t, skip, k)
    master.store(value, low, new, x, skip)


def _on_device(steps: torch.Tensor, update: Update) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared hyperparameters `h` (skip flag last) and per-tensor bias corrections `c`,
    made on the device without a host sync."""
    settings, decoupled = update.settings, update.decoupled
    lr, beta1, beta2 = float(settings["lr"]), settings["beta1"], settings["beta2"]
    decay = settings["weight_decay"]
    values = torch.tensor(
        [
            update.factor * (-1.0 if settings["maximize"] else 1.0),
            1.0 - lr * decay if decoupled else 1.0,  # a multiply
            0.0 if decoupled else decay,  # L2: added to the gradient
            1.0 - beta1,
            beta2,
            1.0 - beta2,
            settings["eps"],
            lr,
            beta1,
        ],
        dtype=torch.float64,
    )
    if steps.device.type != "cpu":  # pinned, so the copy does not wait for the device
        values = values.pin_memory()
    values = values.to(steps.device, non_blocking=True)
    counts = steps.double()
    found_inf = update.found_inf
    skip = found_inf.double().view(1) if found_inf is not None else counts.new_zeros(1)
    hyper = torch.cat([values[:7], skip]).float()
    # Per tensor: lr / (1 - beta1^t) and sqrt(1 - beta2^t).
    corrections = torch.stack(
        [values[7] / (1.0 - values[8].pow(counts)), (1.0 - values[4].pow(counts)).sqrt()], 1
    ).float()
    return hyper, corrections


@functools.cache
def _recompiles() -> contextlib.AbstractContextManager:
    """`recompile_limit` raised to `RECOMPILES` for our graphs only; cached because `patch`
    builds a class each call."""
    return torch._dynamo.config.patch(recompile_limit=RECOMPILES)


@functools.cache
def _graph() -> Callable[..., None]:
    """`_update_one`, compiled on first use; inductor's size asserts off (dynamo's guards
    check the sizes)."""
    options = {"size_asserts": False}
    return torch.compile(_update_one, dynamic=True, fullgraph=True, options=options)
