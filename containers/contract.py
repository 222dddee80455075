"""What torch's `Optimizer` contract needs by hand over inner optimizers: every
hyperparameter in `defaults` (schedulers look for `betas` there) and a state view (the step
hooks: `containers.container`)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["NON_NEGATIVE", "StateView", "defaults_of", "setting_problems"]

NON_NEGATIVE = ("lr", "eps", "weight_decay", "momentum")
"""Hyperparameters torch's constructors refuse below 0 (each a number; Adafactor's eps a pair)."""

Hooks = Mapping[int, Callable[..., Any]]


def defaults_of(cls: type[Optimizer], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Every hyperparameter of `cls`: its constructor's defaults, with `kwargs` over them."""
    defaults = {
        name: p.default
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if name not in ("self", "params")
        and p.default is not inspect.Parameter.empty
        and p.kind is not inspect.Parameter.VAR_KEYWORD
    }
    return defaults | dict(kwargs)


def setting_problems(group: Mapping[str, Any]) -> list[str]:
    """What torch's constructors would refuse in `group`'s hyperparameters, and numbers that
    are not finite, as `key = value: why` each."""
    problems = []
    for key in NON_NEGATIVE:
        value = group.get(key)
        for v in value if isinstance(value, (tuple, list)) else (value,):
            why = _number_problem(v, 0.0, math.inf)
            if why:
                problems.append(f"{key} = {v!r}: {why}")
    betas = group.get("betas")
    if betas is not None:
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            problems.append(f"betas = {betas!r}: expected a pair of numbers in [0, 1)")
        else:
            whys = (_number_problem(b, 0.0, 1.0) for b in betas)
            problems += [f"betas = {tuple(betas)!r}: {why}" for why in whys if why]
    return problems


def _number_problem(value: Any, low: float, high: float) -> str | None:
    """Why `value` is no number in [low, high) (None: it is, or it is unset)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            return f"expected a number, got a {value.dtype} tensor of shape {tuple(value.shape)}"
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"expected a number, got {type(value).__name__}"
    if not math.isfinite(value):
        return "not finite"
    if not low <= value < high:
        return f"outside [{low:g}, {high:g})"
    return None


class StateView(Mapping):
    """Every inner optimizer's per-parameter state, read-only. Not a ChainMap: looking a
    parameter up in the torch defaultdicts of optimizers that do not own it would insert it."""

    def __init__(self, optimizers: Sequence[Optimizer]) -> None:
        self._optimizers = optimizers

    def __getitem__(self, p: torch.Tensor) -> dict[str, Any]:
        for opt in self._optimizers:
            if p in opt.state:
                return opt.state[p]
        raise KeyError(p)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for opt in self._optimizers for p in opt.state)

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._optimizers)
