"""What torch's `Optimizer` contract needs by hand over inner optimizers: every
hyperparameter in `defaults` (schedulers look for `betas` there) and a state view (the step
hooks: `containers.container`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["StateView", "defaults_of"]

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
