"""An Adam/AdamW param group stepping its own parameters: torch's `adam` for fp32 moments,
else the update engine (`containers.update`) over the group's moment codec: widened into
fp32 scratch, bitwise torch's fused step on the widened moments; bf16 moments where torch's
kernel takes them as they are, bitwise torch's `AdamW(fused=True)` with bf16 state."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.adam import adam

from containers.tensors import local, local_form
from containers.update.codecs import MASTER_CODECS, MOMENT_CODECS
from containers.update.driver import Slot, Update, run
from containers.update.plan import plan_of

__all__ = ["MOMENTS", "step_group"]

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def step_group(
    cls: type[Optimizer],
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
    """One Adam/AdamW update of `group` of a `cls` optimizer through its plan; a set
    `found_inf` no-ops."""
    beta1, beta2 = group["betas"]
    settings = dict(
        amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
        weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
        decoupled_weight_decay=group["decoupled_weight_decay"],
    )  # fmt: skip
    plan = plan_of(cls, group)
    if not plan.engine:
        adam(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
            foreach=group["foreach"], capturable=group["capturable"],
            differentiable=group["differentiable"], fused=group["fused"],
            has_complex=has_complex, found_inf=found_inf, **settings,
        )  # fmt: skip
        return
    torch._foreach_add_(steps, 1)
    moments = [exp_avgs, exp_avg_sqs, max_exp_avg_sqs][: 3 if group["amsgrad"] else 2]
    codec = MOMENT_CODECS[plan.moments]
    slots = [
        Slot(local(p), local(g), [local_form(m[i]) for m in moments], steps[i])
        for i, (p, g) in enumerate(zip(params, grads))
    ]
    hyper = {k: v for k, v in settings.items() if k != "decoupled_weight_decay"}
    codecs = [(n, codec) for n in MOMENTS[: len(moments)]]
    decoupled = settings["decoupled_weight_decay"]
    update = Update(MASTER_CODECS["param"], codecs, hyper, decoupled, found_inf=found_inf)
    run(slots, update, compiled=plan.compiled)
    if found_inf is not None:
        torch._foreach_sub_(steps, [found_inf] * len(steps))
