"""What torch's `Optimizer` contract needs by hand over inner optimizers: every
hyperparameter in `defaults` (schedulers look for `betas` there), step hooks (global ones
too) that see the container once per step, never its inner optimizers, and a state view."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim import optimizer as torch_optimizer

__all__ = ["StateView", "defaults_of", "inner_steps", "with_step_hooks"]

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


def with_step_hooks(
    optimizer: Optimizer, pre: Hooks, post: Hooks, apply: Callable[[], None]
) -> None:
    """Run `apply` as `optimizer`'s step between its step hooks, in torch's order."""
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}
    for hook in [*torch_optimizer._global_optimizer_pre_hooks.values(), *pre.values()]:
        result = hook(optimizer, args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(
                    f"step pre hook {hook!r} must return None or (args, kwargs), not {result!r}"
                )
            args, kwargs = result
    with inner_steps():
        apply()
    for hook in [*post.values(), *torch_optimizer._global_optimizer_post_hooks.values()]:
        hook(optimizer, args, kwargs)


@contextmanager
def inner_steps() -> Iterator[None]:
    """Inner steps without torch's global step hooks (their tables emptied meanwhile)."""
    tables = (
        torch_optimizer._global_optimizer_pre_hooks,
        torch_optimizer._global_optimizer_post_hooks,
    )
    saved = [dict(t) for t in tables]
    for t in tables:
        t.clear()
    try:
        yield
    finally:
        for t, hooks in zip(tables, saved):
            t.update(hooks)


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
