"""`TrainSpec`: the builder callables a model family plugs into `train.py`, and their registry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from components.optimizer import build_optimizers
from config import ConfigError

__all__ = ["TrainSpec", "get_train_spec", "register_train_spec", "registered_train_specs"]


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """How to build each piece of a training job for one model family."""

    name: str
    """Key under which the spec is registered (`[model] name`)."""

    build_model_fn: Callable[..., Any]
    """(job_config) -> model on the meta device or CPU."""

    parallelize_fn: Callable[..., Any]
    """(model, job_config, mesh) -> list of model parts, sharded as configured."""

    build_loss_fn: Callable[..., Any]
    """(job_config) -> loss(logits, labels)."""

    build_dataloader_fn: Callable[..., Any]
    """(job_config, dp_rank, dp_world_size) -> stateful iterator of (inputs, labels)."""

    build_lr_schedulers_fn: Callable[..., Any] | None = None
    """(optimizers, job_config) -> LR schedulers; None keeps the lr constant."""

    build_optimizers_fn: Callable[..., Any] = build_optimizers
    """(model_parts, optimizer_config, *, job_config, **runtime) -> OptimizersContainer."""


_SPECS: dict[str, TrainSpec] = {}


def register_train_spec(spec: TrainSpec) -> None:
    """Add `spec` under `spec.name`; a name can be registered once."""
    if not isinstance(spec, TrainSpec):
        raise ValueError(f"register_train_spec({spec!r}): expected a TrainSpec")
    if spec.name in _SPECS:
        raise ValueError(f"train spec {spec.name!r} is already registered; pick another name")
    _SPECS[spec.name] = spec


def get_train_spec(name: str) -> TrainSpec:
    """The spec registered as `name`."""
    if name not in _SPECS:
        known = ", ".join(sorted(_SPECS)) or "none"
        raise ConfigError(f"[model] name = {name!r}: unknown train spec; registered: {known}")
    return _SPECS[name]


def registered_train_specs() -> list[str]:
    return sorted(_SPECS)
