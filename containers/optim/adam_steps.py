"""The update paths of an Adam/AdamW param group (`paths.adam_path`). bf16 moments stepped
as they are are bitwise torch's `AdamW(fused=True)` with bf16 state, an ulp from the widened
step; widened, bitwise torch's fused step on the widened moments."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.adam import adam

from containers.optim.coded_adam import coded_adam
from containers.optim.compiled_adam import compiled_adam, compiled_coded_adam, takes_codes
from containers.optim.paths import adam_path
from containers.tensors import local, scratch, scratch_numel

__all__ = ["lean_adam", "step_coded", "step_compiled", "step_group"]


def step_group(
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
    """One Adam/AdamW update through the group's `adam_path`; a set `found_inf` no-ops."""
    beta1, beta2 = group["betas"]
    settings = dict(
        amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
        weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
        decoupled_weight_decay=group["decoupled_weight_decay"],
    )  # fmt: skip
    path = adam_path(group)
    if path == "torch":
        adam(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
            foreach=group["foreach"], capturable=group["capturable"],
            differentiable=group["differentiable"], fused=group["fused"],
            has_complex=has_complex, found_inf=found_inf, **settings,
        )  # fmt: skip
        return
    torch._foreach_add_(steps, 1)
    if path in ("8bit scratch", "8bit compiled"):
        step_coded(params, grads, exp_avgs, exp_avg_sqs, steps, found_inf, settings,
                   compiled=path == "8bit compiled")  # fmt: skip
    elif path == "compiled":
        step_compiled(params, grads, exp_avgs, exp_avg_sqs, steps, found_inf, settings)
    else:
        lean_adam(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, found_inf=found_inf,
            widen=path == "bf16 scratch", **settings,
        )  # fmt: skip
    if found_inf is not None:
        torch._foreach_sub_(steps, [found_inf] * len(steps))


@torch.no_grad()
def lean_adam(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    amsgrad: bool,
    beta1: float,
    beta2: float,
    lr: float | torch.Tensor,
    weight_decay: float,
    eps: float,
    maximize: bool,
    decoupled_weight_decay: bool,
    found_inf: torch.Tensor | None = None,
    widen: bool = True,
) -> None:
    """Adam/AdamW over moments narrower than the parameters via torch's fused kernel, `widen`ed
    into fp32 scratch chunk by chunk (exact round trip) or as they are; `steps` come advanced."""
    kernel = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
    settings = dict(
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad,
        maximize=maximize, grad_scale=None, found_inf=found_inf,
    )  # fmt: skip
    n_moments = 3 if amsgrad else 2
    budget = scratch_numel(local(params[0]).device) if params else 0
    chunk = budget // n_moments
    moments = [exp_avgs, exp_avg_sqs, max_exp_avg_sqs][:n_moments]

    def run(pieces: list[tuple[torch.Tensor, ...]]) -> None:  # (param, grad, step, *moments)
        p, g, s, *ms = (list(column) for column in zip(*pieces))
        kernel(p, g, ms[0], ms[1], ms[2] if amsgrad else [], s, **settings)

    batch: list[tuple[torch.Tensor, ...]] = []  # pieces to widen, at most `chunk` elements
    filled = 0

    def flush() -> None:  # `batch` on fp32 copies of its moments, a scratch region each
        nonlocal filled
        if not batch:
            return
        buffer = scratch(batch[0][0].device, budget)
        sizes = [piece[0].numel() for piece in batch]
        wide = [list(buffer[m * chunk : m * chunk + filled].split(sizes)) for m in range(n_moments)]
        narrow = [[piece[3 + m] for piece in batch] for m in range(n_moments)]
        for w, n in zip(wide, narrow):
            torch._foreach_copy_(w, n)
        run([(*piece[:3], *ws) for piece, *ws in zip(batch, *wide)])
        for w, n in zip(wide, narrow):
            torch._foreach_copy_(n, w)
        batch.clear()
        filled = 0

    direct: dict[torch.dtype, list[tuple[torch.Tensor, ...]]] = {}  # stepped as they are
    for i, param in enumerate(params):
        p, g = local(param), local(grads[i])
        ms = [local(moment[i]) for moment in moments]
        if not widen or p.dtype == ms[0].dtype:
            direct.setdefault(p.dtype, []).append((p, g, steps[i], *ms))
            continue
        flat = [t.view(-1) for t in (p, g, *ms)]
        for start in range(0, p.numel(), chunk):
            pieces = [t[start : start + chunk] for t in flat]
            if filled + pieces[0].numel() > chunk:
                flush()
            batch.append((pieces[0], pieces[1], steps[i], *pieces[2:]))
            filled += pieces[0].numel()
    flush()
    for pieces in direct.values():
        run(pieces)


@torch.no_grad()
def step_compiled(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    found_inf: torch.Tensor | None,
    settings: dict[str, Any],
) -> None:
    """A `compiled` group's update as one inductor graph (contiguous tensors: `LeanAdam`)."""
    pieces = [[local(t) for t in ts] for ts in (params, grads, exp_avgs, exp_avg_sqs)]
    live = [i for i, p in enumerate(pieces[0]) if p.numel()]
    if live:
        p, g, m, v = ([ts[i] for i in live] for ts in pieces)
        counts = torch.stack([steps[i] for i in live])
        compiled_adam(g, None, p, m, v, counts, **_graph_settings(settings, found_inf))


@torch.no_grad()
def step_coded(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[Any],
    exp_avg_sqs: list[Any],
    steps: list[torch.Tensor],
    found_inf: torch.Tensor | None,
    settings: dict[str, Any],
    compiled: bool = False,
) -> None:
    """An "8bit" group's update: coded moments, and bf16 ones of small parameters."""
    lists = (params, grads, exp_avgs, exp_avg_sqs, steps)
    codes, plain = _split(lists, [isinstance(m, dict) for m in exp_avgs])
    if plain[0] and compiled:
        step_compiled(*plain, found_inf, settings)
    elif plain[0]:
        lean_adam(*plain[:4], [], plain[4], found_inf=found_inf, **settings)
    if not codes[0]:
        return
    ps, gs = [local(p) for p in codes[0]], [local(g) for g in codes[1]]
    moments = [
        [local(t) for t in (m["code"], m["scale"], v["code"], v["scale"])]
        for m, v in zip(codes[2], codes[3])
    ]
    in_graph = [
        compiled and p.numel() > 0 and takes_codes(p, g, c) for p, g, c in zip(ps, gs, moments)
    ]
    graph, rest = _split((ps, gs, moments, codes[4]), in_graph)
    if graph[0]:
        p, g, c, s = graph
        compiled_coded_adam(g, p, c, torch.stack(s), **_graph_settings(settings, found_inf))
    if rest[0]:
        kernel = torch._fused_adamw_ if settings["decoupled_weight_decay"] else torch._fused_adam_
        hyper = {k: v for k, v in settings.items() if k != "decoupled_weight_decay"}
        coded_adam(
            *rest, kernel=kernel, settings={**hyper, "grad_scale": None, "found_inf": found_inf}
        )


def _split(lists: tuple[list[Any], ...], flags: list[bool]) -> tuple[list[list], list[list]]:
    return (
        [[t for t, f in zip(ts, flags) if f] for ts in lists],
        [[t for t, f in zip(ts, flags) if not f] for ts in lists],
    )


def _graph_settings(settings: dict[str, Any], found_inf: torch.Tensor | None) -> dict[str, Any]:
    rest = {k: v for k, v in settings.items() if k != "amsgrad"}
    return {**rest, "lr": float(rest["lr"]), "found_inf": found_inf}
