"""The optimizer and container registries: `register_optimizer(name, factory)` adds an
optimizer (the factory maps the `[optimizer]` config to `(optimizer_cls, kwargs)`),
`register_container(name, factory)` a container variant (`[optimizer] container`); torch's
optimizers (and their lean twins) are registered here, the built-in containers in
`components.optimizer.build`, which builds them. Both are re-exported by `components.optimizer`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from components.optimizer.settings import (
    COMPILED,
    adafactor_kwargs,
    adagrad_kwargs,
    adam_kwargs,
    momentum_kwargs,
    muon_kwargs,
)
from config import ConfigError
from config import Optimizer as OptimizerConfig
from containers import (
    Gate,
    LeanAdam,
    LeanAdamW,
    LeanSGD,
    OptimizersContainer,
    Outer,
    ParamGroupRule,
    Precision,
    ShadowWeights,
    ShardedMuon,
    Timing,
)
from containers.update.forms import CODED

__all__ = [
    "CONTAINERS",
    "LEAN",
    "OPTIMIZERS",
    "ContainerFactory",
    "OptimizerFactory",
    "register_container",
    "register_optimizer",
    "registered_containers",
    "registered_optimizers",
    "resolve_optimizer",
]

OptimizerFactory = Callable[[OptimizerConfig], tuple[type[Optimizer], dict[str, Any]]]


class ContainerFactory(Protocol):
    """Builds a container from the parts `build_optimizers` composed (plus any runtime
    objects a third-party container asks its caller for)."""

    def __call__(
        self,
        model_parts: list[nn.Module],
        optimizer_cls: type[Optimizer],
        optimizer_kwargs: dict[str, Any],
        *,
        param_groups: Sequence[ParamGroupRule],
        precision: Precision,
        gate: Gate | None,
        timing: Timing | None,
        outer: Outer | None,
        max_norm: float | None,
        mesh: DeviceMesh | None,
        ema: ShadowWeights | None,
        **runtime: Any,
    ) -> OptimizersContainer: ...


OPTIMIZERS: dict[str, OptimizerFactory] = {}
"""`[optimizer] name` -> its factory (add with `register_optimizer`)."""
CONTAINERS: dict[str, ContainerFactory] = {}
"""`[optimizer] container` -> its factory (add with `register_container`)."""


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
    _register(OPTIMIZERS, "optimizer", name, factory)


def register_container(name: str, factory: ContainerFactory) -> None:
    """Make `[optimizer] container = "<name>"` build its container with `factory`."""
    _register(CONTAINERS, "container", name, factory)


def registered_optimizers() -> list[str]:
    return sorted(OPTIMIZERS)


def registered_containers() -> list[str]:
    return sorted(CONTAINERS)


def _lean_moments(cfg: OptimizerConfig) -> bool:
    """Whether the section or any of its groups keeps moments in a lower dtype."""
    dtypes = {cfg.moment_dtype, *(g.moment_dtype for g in cfg.param_groups)}
    return bool(dtypes - {None, "float32"})


def _plain_or_lean(
    plain: type[Optimizer],
    lean: type[Optimizer],
    settings: Callable[[OptimizerConfig], dict[str, Any]],
) -> OptimizerFactory:
    """Adam's, AdamW's or SGD's factory: torch's class, or its lean twin when any group keeps
    bf16 state (one class for every group, so a part keeps one inner optimizer)."""

    def factory(cfg: OptimizerConfig) -> tuple[type[Optimizer], dict[str, Any]]:
        if not _lean_moments(cfg) and not (cfg.implementation == "compiled" and lean in COMPILED):
            return plain, settings(cfg)
        return lean, {**settings(cfg), "moment_dtype": cfg.moment_dtype}

    return factory


LEAN: dict[type[Optimizer], type[Optimizer]] = {
    torch.optim.Adam: LeanAdam,
    torch.optim.AdamW: LeanAdamW,
    torch.optim.SGD: LeanSGD,
}
"""Torch's classes that have a lean twin (bf16 or 8-bit state), and the twin."""
for _cls, _lean_cls in LEAN.items():
    _settings = momentum_kwargs if _cls is torch.optim.SGD else adam_kwargs
    register_optimizer(_cls.__name__, _plain_or_lean(_cls, _lean_cls, _settings))
for _cls in (
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
):
    register_optimizer(_cls.__name__, lambda cfg, cls=_cls: (cls, adam_kwargs(cfg)))
register_optimizer("Adagrad", lambda cfg: (torch.optim.Adagrad, adagrad_kwargs(cfg)))
# torch's Muon math with Newton-Schulz on whole matrices of sharded parameters, the work
# spread over the ranks (torch's own gathers every matrix on every rank).
register_optimizer(
    "Muon", lambda cfg: (ShardedMuon, {**muon_kwargs(cfg), "moment_dtype": cfg.moment_dtype})
)
register_optimizer("Adafactor", lambda cfg: (torch.optim.Adafactor, adafactor_kwargs(cfg)))


def resolve_optimizer(
    cfg: OptimizerConfig, name: str | None = None, where: str = "[optimizer]", key: str = "name"
) -> tuple[type[Optimizer], dict[str, Any]]:
    """The registered optimizer `name` (default `cfg.name`): its class and hyperparameters;
    `where` and `key` name the config key that asked for it in an error."""
    name = cfg.name if name is None else name
    if name not in OPTIMIZERS:
        known = ", ".join(registered_optimizers())
        raise ConfigError(
            f"{where} {key} = {name!r}: unknown optimizer; registered: {known} "
            "(add one with components.optimizer.register_optimizer)"
        )
    cls, kwargs = OPTIMIZERS[name](cfg)
    if cfg.moment_dtype != "float32":
        if "moment_dtype" not in kwargs:
            raise ConfigError(
                f"{where} moment_dtype = {cfg.moment_dtype!r}: {name} keeps its state in the "
                "parameters' dtype here (bf16 state is Adam's, AdamW's, SGD's and Muon's); set "
                "this group's moment_dtype = 'float32' or use one of those"
            )
        if cfg.moment_dtype in CODED and cls not in (LeanAdam, LeanAdamW):
            raise ConfigError(
                f"{where} moment_dtype = {cfg.moment_dtype!r}: codes are Adam's and AdamW's "
                f"moments, not {name}'s state; use moment_dtype = 'bfloat16' here"
            )
        if cfg.implementation in ("foreach", "for-loop") and cls in (LeanAdam, LeanAdamW):
            raise ConfigError(
                f"[optimizer] implementation = {cfg.implementation!r}: bf16 moments "
                f"({where} moment_dtype) step through torch's fused kernel over fp32 "
                "scratch; use implementation 'auto' or 'fused'"
            )
    return cls, kwargs
