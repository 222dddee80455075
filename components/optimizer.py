"""Optimizer and container registries, and `build_optimizers` that turns config into a container.

`register_optimizer(name, factory)` adds an optimizer: the factory maps the `[optimizer]` config
to `(optimizer_cls, kwargs)`. `register_container(name, factory)` adds a container variant,
selected by `[optimizer] container`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.optim import Optimizer

from config import ConfigError, JobConfig
from config import Optimizer as OptimizerConfig
from containers import (
    LossScaler,
    MixedPrecisionOptimizersContainer,
    OptimizersContainer,
    OptimizersInBackwardContainer,
    ParamGroupRule,
)

__all__ = [
    "build_optimizers",
    "implementation_kwargs",
    "register_container",
    "register_optimizer",
    "registered_containers",
    "registered_optimizers",
    "resolve_optimizer",
]

OptimizerFactory = Callable[[OptimizerConfig], tuple[type[Optimizer], dict[str, Any]]]


class ContainerFactory(Protocol):
    def __call__(
        self,
        model_parts: list[nn.Module],
        optimizer_cls: type[Optimizer],
        optimizer_kwargs: dict[str, Any],
        *,
        param_groups: Sequence[ParamGroupRule],
        job_config: JobConfig | None,
        **runtime: Any,
    ) -> OptimizersContainer: ...


_OPTIMIZERS: dict[str, OptimizerFactory] = {}
_CONTAINERS: dict[str, ContainerFactory] = {}


def _register(table: dict[str, Any], kind: str, name: str, factory: Any) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name {name!r}: expected a non-empty string")
    if name in table:
        raise ValueError(f"{kind} {name!r} is already registered; pick another name")
    if not callable(factory):
        raise ValueError(f"{kind} {name!r}: factory {factory!r} is not callable")
    table[name] = factory


def register_optimizer(name: str, factory: OptimizerFactory) -> None:
    """Make `[optimizer] name = "<name>"` build the `(cls, kwargs)` that `factory` returns."""
    _register(_OPTIMIZERS, "optimizer", name, factory)


def register_container(name: str, factory: ContainerFactory) -> None:
    """Make `[optimizer] container = "<name>"` build its container with `factory`."""
    _register(_CONTAINERS, "container", name, factory)


def registered_optimizers() -> list[str]:
    return sorted(_OPTIMIZERS)


def registered_containers() -> list[str]:
    return sorted(_CONTAINERS)


def _adam_kwargs(cfg: OptimizerConfig) -> dict[str, Any]:
    return {
        "lr": cfg.lr,
        "betas": (cfg.beta1, cfg.beta2),
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
    }


register_optimizer("Adam", lambda cfg: (torch.optim.Adam, _adam_kwargs(cfg)))
register_optimizer("AdamW", lambda cfg: (torch.optim.AdamW, _adam_kwargs(cfg)))
register_optimizer(
    "SGD",
    lambda cfg: (
        torch.optim.SGD,
        {"lr": cfg.lr, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay},
    ),
)


def _fused_devices() -> set[str]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return set(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - older torch
        return {"cuda", "cpu"}


def implementation_kwargs(
    optimizer_cls: type[Optimizer], implementation: str, device: torch.device, where: str
) -> dict[str, bool]:
    """Kernel flags for `implementation` ("auto" picks fused where torch has it on `device`)."""
    accepted = inspect.signature(optimizer_cls).parameters
    fused_ok = "fused" in accepted and device.type in _fused_devices()
    name = optimizer_cls.__name__
    if implementation == "auto":
        return {"fused": True} if fused_ok else {}
    if implementation == "fused":
        if not fused_ok:
            why = "has no fused kernel" if "fused" not in accepted else f"has none on {device}"
            raise ConfigError(
                f"{where} implementation = 'fused': {name} {why}; use 'auto' or 'foreach'"
            )
        return {"fused": True}
    if "foreach" not in accepted:
        raise ConfigError(
            f"{where} implementation = {implementation!r}: {name} takes no foreach flag; use 'auto'"
        )
    flags = {"foreach": implementation == "foreach"}
    if "fused" in accepted:
        flags["fused"] = False
    return flags


def resolve_optimizer(
    cfg: OptimizerConfig, name: str | None = None, where: str = "[optimizer]"
) -> tuple[type[Optimizer], dict[str, Any]]:
    """The registered optimizer `name` (default `cfg.name`): its class and hyperparameters."""
    name = cfg.name if name is None else name
    if name not in _OPTIMIZERS:
        known = ", ".join(registered_optimizers())
        raise ConfigError(
            f"{where} name = {name!r}: unknown optimizer; registered: {known} "
            "(add one with components.optimizer.register_optimizer)"
        )
    return _OPTIMIZERS[name](cfg)


def _device(model_parts: Sequence[nn.Module]) -> torch.device:
    devices = {p.device for m in model_parts for p in m.parameters() if p.requires_grad}
    if len(devices) > 1:
        raise ValueError(f"trainable parameters span devices {sorted(map(str, devices))}")
    return next(iter(devices), torch.device("cpu"))


def build_optimizers(
    model_parts: Sequence[nn.Module],
    optimizer_config: OptimizerConfig,
    *,
    job_config: JobConfig | None = None,
    **runtime: Any,
) -> OptimizersContainer:
    """Build the container that `optimizer_config.container` names over `model_parts`.

    Args:
        model_parts: the model parts to optimize.
        optimizer_config: the `[optimizer]` section.
        job_config: the whole job config, for variants that read other sections.
        **runtime: runtime objects a variant needs (process groups, the ft manager, ...).
    """
    cfg = optimizer_config
    container = cfg.container
    if container == "default" and job_config is not None and job_config.fault_tolerance.enable:
        container = "fault_tolerant"  # [fault_tolerance] enable = true picks it by itself
    if container not in _CONTAINERS:
        raise ConfigError(
            f"[optimizer] container = {container!r}: unknown container; registered: "
            f"{', '.join(registered_containers())}"
        )
    device = _device(model_parts)
    cls, kwargs = resolve_optimizer(cfg)
    kwargs |= implementation_kwargs(cls, cfg.implementation, device, "[optimizer]")
    rules = []
    for i, group in enumerate(cfg.param_groups):
        where = f"[optimizer.param_groups[{i}]]"
        overrides = {
            f.name: getattr(group, f.name)
            for f in dataclasses.fields(group)
            if f.name not in ("pattern", "name") and getattr(group, f.name) is not None
        }
        group_cfg = dataclasses.replace(cfg, **overrides)
        group_cls, group_kwargs = resolve_optimizer(group_cfg, group.name or cfg.name, where)
        group_kwargs |= implementation_kwargs(group_cls, cfg.implementation, device, where)
        if group_cls is cls:
            diff = {k: v for k, v in group_kwargs.items() if kwargs.get(k) != v}
            rules.append(ParamGroupRule(group.pattern, diff))
        else:
            rules.append(ParamGroupRule(group.pattern, {}, group_cls, group_kwargs))
    try:
        return _CONTAINERS[container](
            list(model_parts), cls, kwargs, param_groups=rules, job_config=job_config, **runtime
        )
    except ConfigError:
        raise
    except ValueError as e:
        # The containers check model against config (patterns, ownership); say which section.
        raise ConfigError(f"[optimizer] {e}") from e


def _build_default(
    model_parts: list[nn.Module],
    optimizer_cls: type[Optimizer],
    optimizer_kwargs: dict[str, Any],
    *,
    param_groups: Sequence[ParamGroupRule],
    job_config: JobConfig | None,
    **runtime: Any,
) -> OptimizersContainer:
    return OptimizersContainer(
        model_parts, optimizer_cls, optimizer_kwargs, param_groups=param_groups
    )


register_container("default", _build_default)


def _build_in_backward(
    model_parts: list[nn.Module],
    optimizer_cls: type[Optimizer],
    optimizer_kwargs: dict[str, Any],
    *,
    param_groups: Sequence[ParamGroupRule],
    job_config: JobConfig | None,
    gradient_accumulation_steps: int | None = None,
    **runtime: Any,
) -> OptimizersInBackwardContainer:
    training = job_config.training if job_config is not None else None
    if training is not None and training.max_norm > 0:
        raise ConfigError(
            f"[training] max_norm = {training.max_norm}: container 'in_backward' steps each "
            "parameter as soon as its gradient is ready, before the global norm exists, so "
            "it cannot clip; set max_norm = 0 or use container = 'default'"
        )
    if job_config is not None and job_config.fault_tolerance.enable:
        raise ConfigError(
            "[fault_tolerance] enable = true: container 'in_backward' steps inside backward, "
            "before torchft can decide whether the step commits; use container "
            "'fault_tolerant' or disable fault tolerance"
        )
    if gradient_accumulation_steps is None:
        gradient_accumulation_steps = training.gradient_accumulation_steps if training else 1
    return OptimizersInBackwardContainer(
        model_parts,
        optimizer_cls,
        optimizer_kwargs,
        param_groups=param_groups,
        gradient_accumulation_steps=gradient_accumulation_steps,
    )


register_container("in_backward", _build_in_backward)


def _build_mixed_precision(
    model_parts: list[nn.Module],
    optimizer_cls: type[Optimizer],
    optimizer_kwargs: dict[str, Any],
    *,
    param_groups: Sequence[ParamGroupRule],
    job_config: JobConfig | None,
    **runtime: Any,
) -> MixedPrecisionOptimizersContainer:
    cfg = job_config if job_config is not None else JobConfig()
    mp = cfg.mixed_precision
    if cfg.fault_tolerance.enable:
        raise ConfigError(
            "[fault_tolerance] enable = true: container 'mixed_precision' does not run under "
            "torchft yet; disable one of them"
        )
    scaler = LossScaler(
        mode=mp.loss_scaling,
        scale=mp.initial_scale,
        growth_factor=mp.growth_factor,
        backoff_factor=mp.backoff_factor,
        growth_interval=mp.growth_interval,
        hysteresis=mp.hysteresis,
        min_scale=mp.min_scale,
        max_scale=mp.max_scale,
    )
    return MixedPrecisionOptimizersContainer(
        model_parts,
        optimizer_cls,
        optimizer_kwargs,
        param_groups=param_groups,
        param_dtype=getattr(torch, mp.param_dtype),
        master_dtype=getattr(torch, mp.master_dtype),
        max_norm=cfg.training.max_norm,
        loss_scaler=scaler,
        compile=mp.compile,
    )


register_container("mixed_precision", _build_mixed_precision)
