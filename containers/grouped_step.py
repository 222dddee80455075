"""Step the like Adam/AdamW groups of many inner optimizers in one fused (or foreach) call,
collected through each optimizer's own `_init_group`: bitwise each stepping alone, since these
kernels compute each tensor from its own gradient, state and step."""

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
        type(opt) in ADAMS
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
            [(*_KEY(g), g.get("moment_dtype"), g.get("compiled")) for g in groups]
            if _plain(opt) and _own_step(opt)  # nothing but the update happens in its step()
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
    # params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps: as torch's step collects them
    lists: tuple[list[torch.Tensor], ...] = ([], [], [], [], [], [])
    has_complex = False
    for opt, group in groups:
        has_complex |= opt._init_group(group, *lists)  # type: ignore[attr-defined]
    if lists[0]:
        cls, group = type(groups[0][0]), groups[0][1]
        step_group(cls, group, *lists, has_complex=has_complex, found_inf=found_inf)
