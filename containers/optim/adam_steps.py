"""The update paths of an Adam/AdamW param group (`step_group`), which `LeanAdam(W)` and the
grouped step take: torch's functional `adam` for float32 moments; for bf16 moments
(`lean_adam`) torch's fused kernel on each chunk of moments (`scratch`-sized,
cache-resident) widened into fp32 scratch and rounded back to nearest, so a lean step is, bit
for bit, torch's fused step on the fp32 values of the bf16 moments followed by rounding them
(tests hold this), the parameters themselves staying fp32; 8-bit codes (`step_coded`,
`containers.optim.coded_adam`); and `compiled` groups as one inductor graph
(`containers.optim.compiled_adam`).

Where torch's own fused kernel takes bf16 moments beside fp32 parameters (its
mixed-precision CUDA kernel, absent from torch 2.11: `lean.fused_takes_bf16_moments` asks the
device once), it steps them as they are, no scratch: bit for bit what torch's
`AdamW(fused=True)` does with bf16 state (torchtitan's `fused_opt_states_bf16`), whose bias
corrections are taken in fp64, so its bits may differ from the widened step's by an ulp.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.adam import adam

from containers.norm import local, scratch, scratch_numel
from containers.optim.coded_adam import CODED, coded_adam
from containers.optim.compiled_adam import compiled_adam, compiled_coded_adam, takes_codes
from containers.optim.lean import fused_takes_bf16_moments

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
    """One Adam/AdamW update of a group's collected tensors: torch's functional `adam`,
    `lean_adam` for a group that keeps its moments in a lower dtype, or one inductor graph
    for a `compiled` group (`step_compiled`). `found_inf` (fused or compiled groups only, as
    torch's): set, the kernels change nothing and the step counts go back."""
    beta1, beta2 = group["betas"]
    settings = dict(
        amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
        weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
        decoupled_weight_decay=group["decoupled_weight_decay"],
    )  # fmt: skip
    if group.get("moment_dtype") == CODED:
        step_coded(params, grads, exp_avgs, exp_avg_sqs, steps, found_inf, settings,
                   compiled=group.get("compiled", False))  # fmt: skip
        return
    if group.get("compiled"):
        step_compiled(params, grads, exp_avgs, exp_avg_sqs, steps, found_inf, settings)
        return
    if group.get("moment_dtype", "float32") != "float32":
        lean_adam(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, found_inf=found_inf,
            **settings,
        )  # fmt: skip
        return
    adam(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, foreach=group["foreach"],
        capturable=group["capturable"], differentiable=group["differentiable"],
        fused=group["fused"], has_complex=has_complex, found_inf=found_inf, **settings,
    )  # fmt: skip


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
) -> None:
    """Adam/AdamW over moments of a lower dtype than the parameters: torch's fused kernel on
    fp32 scratch copies of them, a chunk at a time, rounded back (see the module docstring).
    Where `found_inf` is set the kernel changes nothing (the moments round-trip exactly
    through fp32) and the step counts go back, as torch's `_fused_adam` does."""
    torch._foreach_add_(steps, 1)
    kernel = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps)
    settings = dict(
        **hyper, amsgrad=amsgrad, maximize=maximize, grad_scale=None, found_inf=found_inf
    )
    n_moments = 3 if amsgrad else 2
    budget = scratch_numel(local(params[0]).device) if params else 0
    chunk = budget // n_moments
    moments = [exp_avgs, exp_avg_sqs, max_exp_avg_sqs][:n_moments]
    batch: list[tuple[torch.Tensor, ...]] = []  # (param, grad, step, *moments) pieces
    filled = 0

    def flush() -> None:
        nonlocal filled
        if not batch:
            return
        buffer = scratch(batch[0][0].device, budget)
        wide = []
        for m in range(n_moments):
            offset, views = m * chunk, []
            for piece in batch:
                views.append(buffer[offset : offset + piece[0].numel()])
                offset += piece[0].numel()
            torch._foreach_copy_(views, [piece[3 + m] for piece in batch])
            wide.append(views)
        p, g, s = ([piece[i] for piece in batch] for i in range(3))
        kernel(p, g, wide[0], wide[1], wide[2] if amsgrad else [], s, **settings)
        for m in range(n_moments):
            torch._foreach_copy_([piece[3 + m] for piece in batch], wide[m])
        batch.clear()
        filled = 0

    direct: list[tuple[torch.Tensor, ...]] = []  # (param, grad, step, *moments) for torch's
    for i, param in enumerate(params):
        p, g = local(param), local(grads[i])
        ms = [local(moment[i]) for moment in moments]
        if _direct(p, g, ms):
            direct.append((p, g, steps[i], *ms))
            continue
        if p.dtype != torch.float32 or not all(t.is_contiguous() for t in (p, g, *ms)):
            _step_whole(kernel, p, g, ms, steps[i], amsgrad, settings)
            continue
        n, begin = p.numel(), 0
        flat = [t.view(-1) for t in (p, g, *ms)]
        for start in range(begin, n, chunk):
            stop = min(start + chunk, n)
            if filled + stop - start > chunk:
                flush()
            pieces = [t[start:stop] for t in flat]
            batch.append((pieces[0], pieces[1], steps[i], *pieces[2:]))
            filled += stop - start
    flush()
    if direct:  # torch's kernel over the bf16 moments themselves: no scratch
        p, g, s, *ms = ([piece[k] for piece in direct] for k in range(3 + n_moments))
        kernel(p, g, ms[0], ms[1], ms[2] if amsgrad else [], s, **settings)
    if found_inf is not None:
        torch._foreach_sub_(steps, [found_inf] * len(steps))


def _direct(p: torch.Tensor, g: torch.Tensor, moments: list[torch.Tensor]) -> bool:
    """Whether torch's fused kernel steps these local tensors as they are: contiguous fp32
    parameter and gradient, bf16 moments, on a device whose kernel takes them
    (`fused_takes_bf16_moments`)."""
    return (
        fused_takes_bf16_moments(p.device)  # (first: on a CPU it ends the test at once)
        and p.dtype == g.dtype == torch.float32
        and all(m.dtype == torch.bfloat16 for m in moments)
        and all(t.is_contiguous() for t in (p, g, *moments))
    )


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
    """A `compiled` group's update: one inductor graph over its tensors, each moment read and
    written in its own dtype (`containers.optim.compiled_adam`); a tensor the graph cannot
    view flat (not contiguous) steps alone through the fused kernel, widened."""
    torch._foreach_add_(steps, 1)
    pieces = [[local(t) for t in ts] for ts in (params, grads, exp_avgs, exp_avg_sqs)]
    live = [i for i, p in enumerate(pieces[0]) if p.numel()]
    flat = [i for i in live if all(ts[i].is_contiguous() for ts in pieces)]
    kernel = torch._fused_adamw_ if settings["decoupled_weight_decay"] else torch._fused_adam_
    whole = {k: v for k, v in settings.items() if k != "decoupled_weight_decay"}
    for i in sorted(set(live) - set(flat)):
        p, g, m, v = (ts[i] for ts in pieces)
        _step_whole(kernel, p, g, [m, v], steps[i], False, whole | {"found_inf": found_inf})
    if flat:
        pick = lambda k: [pieces[k][i] for i in flat]  # noqa: E731
        rest = {k: v for k, v in settings.items() if k != "amsgrad"}
        compiled_adam(
            pick(1), None, pick(0), pick(2), pick(3), torch.stack([steps[i] for i in flat]),
            found_inf=found_inf, **{**rest, "lr": float(rest["lr"])},
        )  # fmt: skip
    if found_inf is not None:
        torch._foreach_sub_(steps, [found_inf] * len(steps))


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
    """An "8bit" group's update: its coded moments through `coded_adam` (`compiled`: one
    inductor graph over those it takes, `compiled_coded_adam`), the bf16 moments of its small
    parameters through `lean_adam` (`compiled`: `step_compiled`)."""
    is_coded = [isinstance(m, dict) for m in exp_avgs]
    lists = (params, grads, exp_avgs, exp_avg_sqs, steps)
    plain, codes = ([[t for t, c in zip(ts, is_coded) if c is want] for ts in lists]
                    for want in (False, True))  # fmt: skip
    if plain[0] and compiled:
        step_compiled(*plain, found_inf, settings)
    elif plain[0]:
        lean_adam(*plain[:4], [], plain[4], found_inf=found_inf, **settings)
    if not codes[0]:
        return
    torch._foreach_add_(codes[4], 1)
    ps, gs = [local(p) for p in codes[0]], [local(g) for g in codes[1]]
    coded_tensors = [
        [local(m["code"]), local(m["scale"]), local(v["code"]), local(v["scale"])]
        for m, v in zip(codes[2], codes[3])
    ]
    graph = [
        i for i, (p, g, c) in enumerate(zip(ps, gs, coded_tensors))
        if compiled and p.numel() and takes_codes(p, g, c)
    ]  # fmt: skip
    if graph:
        hyper = {k: v for k, v in settings.items() if k != "amsgrad"}
        compiled_coded_adam(
            [gs[i] for i in graph], [ps[i] for i in graph], [coded_tensors[i] for i in graph],
            torch.stack([codes[4][i] for i in graph]), found_inf=found_inf,
            **hyper | {"lr": float(hyper["lr"])},
        )  # fmt: skip
    rest = sorted(set(range(len(ps))) - set(graph))
    if rest:
        decoupled = settings["decoupled_weight_decay"]
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        hyper = {k: v for k, v in settings.items() if k != "decoupled_weight_decay"}
        coded_adam(*([ts[i] for i in rest] for ts in codes), kernel=kernel,
                   settings={**hyper, "grad_scale": None, "found_inf": found_inf})  # fmt: skip
    if found_inf is not None:
        torch._foreach_sub_(codes[4], [found_inf] * len(codes[4]))


def _step_whole(
    kernel: Any,
    p: torch.Tensor,
    g: torch.Tensor,
    moments: list[torch.Tensor],
    step: torch.Tensor,
    amsgrad: bool,
    settings: dict[str, Any],
) -> None:
    """A parameter the chunks cannot view (not contiguous, or not fp32): its moments widened
    to the parameter's dtype whole (or stepped in place, already of its dtype)."""
    wide = [m.to(p.dtype) for m in moments]
    kernel([p], [g], [wide[0]], [wide[1]], [wide[2]] if amsgrad else [], [step], **settings)
    for m, w in zip(moments, wide):
        if w is not m:
            m.copy_(w)
