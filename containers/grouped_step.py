"""Step the Adam/AdamW groups of many inner optimizers in one fused (or foreach) call.

The default container builds one inner optimizer per model part and optimizer class, so a
step of K parts made K `opt.step()` calls: K times torch's per-step Python (the profiler
range, hook chains, grad mode, `_init_group`, the functional dispatch) and K kernel calls
where one optimizer over all parameters makes one. At 32 parts of 0.3M parameters that was
1.10-1.30x one fused AdamW (issue 15).

`step_together` gathers the params, grads and state of every group that can step together
(`_KEY`: the same torch class's kernel, the same hyperparameters) across all the optimizers
it is given, each through the optimizer's own `_init_group` (torch's lazy state init, a
parameter without a gradient left out), and makes one call of torch's functional `adam` per
such bucket. Fused and foreach kernels compute every tensor from that tensor's own gradient,
state and step count alone, so the result is bitwise each optimizer stepping alone.

An optimizer takes its own `step()` instead when anything could tell the difference: a step
hook of its own or a global one, a `step` patched on the instance (but torch's LR schedulers'
patch, which only notes that the step ran: that note is made here), a `GradScaler`'s
`grad_scale`/`found_inf`, a subclass, a group without an explicit fused or foreach choice
(torch picks by the tensors' devices), a tensor lr, or `differentiable`. The grouping is
rebuilt on every step from the live group dicts (a few microseconds), so LR schedulers, user
writes and loads, which replace the dicts, are seen.

Why torch's private `_init_group` rather than a public route: the public alternative, one
inner optimizer per optimizer class with a param group per part and rule, does not make one
kernel call either (torch's `Adam.step` calls its functional `adam` once per param group),
and it would make every part's groups one optimizer's, which changes what `__iter__` and
`__len__` give torchtitan-style code that walks one optimizer per model part. `_init_group` is
the one place torch creates Adam's lazy state; calling it keeps that exactly torch's (a test
holds this bitwise over every Adam/AdamW configuration of torch's `optim_db`), so the risk of
the private name is a loud AttributeError on a torch that renames it, not a silent change.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim import optimizer as torch_optimizer

from containers.optim.adam_steps import step_group
from containers.optim.lean_adam import ADAMS

__all__ = ["step_together"]

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
)
"""The group entries that torch's functional `adam` reads: groups agreeing on all of them
(and on the lean classes' `moment_dtype` and `compiled`) step in one call."""


_KEY = itemgetter(*HYPERPARAMETERS)  # one C call per group: this runs on every step
_LR, _FOREACH, _FUSED, _DIFFERENTIABLE = (
    HYPERPARAMETERS.index(k) for k in ("lr", "foreach", "fused", "differentiable")
)


def _mergeable(key: tuple[Any, ...]) -> bool:
    """Whether a group of bucket `key` can step with others: an explicit fused or foreach
    kernel (with None torch picks by the tensors' devices), a float lr, not differentiable."""
    return (
        bool(key[_FUSED] or key[_FOREACH])
        and not key[_DIFFERENTIABLE]
        and not isinstance(key[_LR], torch.Tensor)
    )


def _groupable(opt: Optimizer) -> bool:
    """Whether nothing but the update itself happens in `opt.step()`."""
    return (
        type(opt) in ADAMS
        and not opt._optimizer_step_pre_hooks
        and not opt._optimizer_step_post_hooks
        and _own_step(opt)
        and getattr(opt, "grad_scale", None) is None
        and getattr(opt, "found_inf", None) is None
    )


def _own_step(opt: Optimizer) -> bool:
    """Whether `opt.step` is its class's, or that wrapped by torch's LR schedulers alone
    (train.py builds one on every inner optimizer), which sets `_opt_called` and steps."""
    step = opt.__dict__.get("step")
    return step is None or (
        getattr(step, "_wrapped_by_lr_sched", False)
        and getattr(step, "__wrapped__", None) is type(opt).step
    )


def kernel_skips(optimizers: Sequence[Optimizer]) -> bool:
    """Whether `step_together(optimizers, found_inf)` leaves them exactly as they were where
    `found_inf` is set: every group fused (torch's fused Adam/AdamW kernels, and the lean
    ones, read the flag and take back the step count), no step hooks that would run all the
    same, no `GradScaler` of the caller's own."""
    if torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks:
        return False
    return all(
        type(opt) in ADAMS
        and not opt._optimizer_step_pre_hooks
        and not opt._optimizer_step_post_hooks
        and getattr(opt, "grad_scale", None) is None
        and getattr(opt, "found_inf", None) is None
        and all(g["fused"] for g in opt.param_groups)
        for opt in optimizers
    )


@torch.no_grad()
def step_together(optimizers: Sequence[Optimizer], found_inf: torch.Tensor | None = None) -> None:
    """Step every optimizer of `optimizers` once: bitwise as `opt.step()` for each, with one
    kernel call per bucket of like Adam/AdamW groups (see the module docstring). `found_inf`
    (only where `kernel_skips`): a device flag that, set, makes every kernel change nothing."""
    if torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks:
        for opt in optimizers:
            _step_alone(opt, found_inf)
        return
    buckets: dict[tuple[Any, ...], list[tuple[Optimizer, dict[str, Any]]]] = {}
    for opt in optimizers:
        groups = opt.param_groups
        keys = (
            [(*_KEY(g), g.get("moment_dtype"), g.get("compiled")) for g in groups]
            if _groupable(opt)
            else None
        )
        if keys is None or not all(map(_mergeable, keys)):
            _step_alone(opt, found_inf)
            continue
        opt._opt_called = True  # type: ignore[attr-defined]  (what a scheduler's patch notes)
        for key, group in zip(keys, groups):
            buckets.setdefault(key, []).append((opt, group))
    for groups in buckets.values():
        _step_bucket(groups, found_inf)


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
    groups: list[tuple[Optimizer, dict[str, Any]]], found_inf: torch.Tensor | None = None
) -> None:
    """One functional `adam` (or `lean_adam`) call over `groups` (all of the same bucket)."""
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    exp_avgs: list[torch.Tensor] = []
    exp_avg_sqs: list[torch.Tensor] = []
    max_exp_avg_sqs: list[torch.Tensor] = []
    steps: list[torch.Tensor] = []
    has_complex = False
    for opt, group in groups:
        # Torch's own collection: lazy state init exactly as its step does it.
        has_complex |= opt._init_group(  # type: ignore[attr-defined]
            group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps
        )
    if not params:
        return
    step_group(
        groups[0][1], params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
        has_complex=has_complex, found_inf=found_inf,
    )  # fmt: skip
