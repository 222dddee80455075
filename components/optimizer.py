"""Optimizer and container registries, and `build_optimizers` that turns config into a container.

`register_optimizer(name, factory)` adds an optimizer: the factory maps the `[optimizer]` config
to `(optimizer_cls, kwargs)`. `register_container(name, factory)` adds a container variant,
selected by `[optimizer] container`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from components.optimizer_settings import (
    COMPILED,
    adafactor_kwargs,
    adagrad_kwargs,
    adam_kwargs,
    implementation_kwargs,
    is_sharded,
    momentum_kwargs,
    muon_kwargs,
    refuse_on_shards,
    slower_than_compiled,
)
from config import ConfigError, ParamGroup, steps_in_backward
from config import MixedPrecision as MixedPrecisionConfig
from config import Optimizer as OptimizerConfig
from containers import (
    DiLoCoGate,
    Gate,
    InBackward,
    LeanAdam,
    LeanAdamW,
    LeanSGD,
    MasterWeights,
    MixedPrecisionOptimizersContainer,
    OptimizersContainer,
    ParamGroupRule,
    Precision,
    ShadowWeights,
    ShardedMuon,
    Timing,
    TorchFTGate,
)

__all__ = [
    "OptimizersBuilder",
    "build_optimizers",
    "build_precision",
    "check_names",
    "register_container",
    "register_optimizer",
    "registered_containers",
    "registered_optimizers",
    "resolve_optimizer",
]

logger = logging.getLogger(__name__)

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
        max_norm: float | None,
        mesh: DeviceMesh | None,
        ema: ShadowWeights | None,
        **runtime: Any,
    ) -> OptimizersContainer: ...


class OptimizersBuilder(Protocol):
    """The train spec's `build_optimizers_fn`: `build_optimizers` or a replacement."""

    def __call__(
        self,
        model_parts: Sequence[nn.Module],
        cfg: OptimizerConfig,
        *,
        precision: Precision | None = None,
        gate: Gate | None = None,
        max_norm: float | None = None,
        gradient_accumulation_steps: int = 1,
        mesh: DeviceMesh | None = None,
        ema: ShadowWeights | None = None,
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


_LEAN: dict[type[Optimizer], type[Optimizer]] = {
    torch.optim.Adam: LeanAdam,
    torch.optim.AdamW: LeanAdamW,
    torch.optim.SGD: LeanSGD,
}
for _cls, _lean_cls in _LEAN.items():
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
    cls, kwargs = _OPTIMIZERS[name](cfg)
    if cfg.moment_dtype != "float32":
        if "moment_dtype" not in kwargs:
            raise ConfigError(
                f"{where} moment_dtype = {cfg.moment_dtype!r}: {name} keeps its state in the "
                "parameters' dtype here (bf16 state is Adam's, AdamW's, SGD's and Muon's); set "
                "this group's moment_dtype = 'float32' or use one of those"
            )
        if cfg.moment_dtype == "8bit" and cls not in (LeanAdam, LeanAdamW):
            raise ConfigError(
                f"{where} moment_dtype = '8bit': 8-bit codes are Adam's and AdamW's moments, "
                f"not {name}'s state; use moment_dtype = 'bfloat16' here"
            )
        if cfg.implementation in ("foreach", "for-loop") and cls in (LeanAdam, LeanAdamW):
            raise ConfigError(
                f"[optimizer] implementation = {cfg.implementation!r}: bf16 moments "
                f"({where} moment_dtype) step through torch's fused kernel over fp32 "
                "scratch; use implementation 'auto' or 'fused'"
            )
    return cls, kwargs


def check_names(cfg: OptimizerConfig) -> None:
    """Raise `ConfigError` unless the container and every optimizer `cfg` names are
    registered (cheap: `build_job` checks it before any process group exists)."""
    if cfg.container not in _CONTAINERS:
        raise ConfigError(
            f"[optimizer] container = {cfg.container!r}: unknown container; registered: "
            f"{', '.join(registered_containers())}"
        )
    resolve_optimizer(cfg)
    for i, group in enumerate(cfg.param_groups):
        if group.name is not None:
            where = f"[optimizer.param_groups[{i}]]"
            resolve_optimizer(_group_config(cfg, group, where), group.name, where)


def _device(model_parts: Sequence[nn.Module]) -> torch.device:
    devices = {p.device for m in model_parts for p in m.parameters() if p.requires_grad}
    if len(devices) > 1:
        raise ValueError(f"trainable parameters span devices {sorted(map(str, devices))}")
    return next(iter(devices), torch.device("cpu"))


def build_precision(
    cfg: OptimizerConfig, mixed_precision: MixedPrecisionConfig | None = None
) -> Precision:
    """The precision of the container `cfg.container` names: the job casts the model with it
    (`cast_model`) before sharding, then hands it to `build_optimizers`."""
    if cfg.container == "mixed_precision":
        try:
            return MasterWeights(mixed_precision)
        except ValueError as e:
            raise ConfigError(str(e)) from e
    return Precision()


def _rules(
    cfg: OptimizerConfig,
    cls: type[Optimizer],
    kwargs: dict[str, Any],
    device: torch.device,
    dtensor: bool,
    sharded: bool,
) -> list[ParamGroupRule]:
    rules = []
    for i, group in enumerate(cfg.param_groups):
        where = f"[optimizer.param_groups[{i}]]"
        group_cfg = _group_config(cfg, group, where, say=True)
        group_cls, group_kwargs = resolve_optimizer(group_cfg, group.name or cfg.name, where)
        refuse_on_shards(group_cls, group.name or cfg.name, where, sharded)
        group_kwargs |= implementation_kwargs(group_cls, cfg.implementation, device, where, dtensor)
        if _LEAN.get(group_cls) is cls:  # a float32 group of a lean section: the same class
            group_cls, group_kwargs = cls, {**group_kwargs, "moment_dtype": "float32"}
        if group_cls is cls:
            diff = {k: v for k, v in group_kwargs.items() if kwargs.get(k) != v}
            rules.append(ParamGroupRule(group.pattern, diff))
        else:
            rules.append(ParamGroupRule(group.pattern, {}, group_cls, group_kwargs))
    return rules


def _group_config(
    cfg: OptimizerConfig, group: ParamGroup, where: str, say: bool = False
) -> OptimizerConfig:
    """The `[optimizer]` section with `group`'s own settings over it; in bf16 where the group
    inherits the section's `moment_dtype = "8bit"` and its optimizer keeps bf16 state, not
    codes (SGD's and Muon's momentum): the leanest state it has, as an 8-bit group's vectors
    keep (`say`: in one log line). Set on the group itself, "8bit" is refused by
    `resolve_optimizer` as asked."""
    overrides = {
        f.name: getattr(group, f.name)
        for f in dataclasses.fields(group)
        if f.name not in ("pattern", "name") and getattr(group, f.name) is not None
    }
    group_cfg = dataclasses.replace(cfg, **overrides)
    factory = _OPTIMIZERS.get(group.name or group_cfg.name)
    if group.moment_dtype is not None or group_cfg.moment_dtype != "8bit" or factory is None:
        return group_cfg
    lean = dataclasses.replace(group_cfg, moment_dtype="bfloat16")
    cls, kwargs = factory(lean)
    if cls in (LeanAdam, LeanAdamW) or "moment_dtype" not in kwargs:
        return group_cfg  # codes, or no lean state at all (refused there)
    if say:
        logger.info(
            "%s %s keeps its state in bfloat16 ([optimizer] moment_dtype = '8bit': codes are "
            "Adam's and AdamW's moments)",
            where,
            cls.__name__,
        )
    return lean


def build_optimizers(
    model_parts: Sequence[nn.Module],
    cfg: OptimizerConfig,
    *,
    precision: Precision | None = None,
    gate: Gate | None = None,
    max_norm: float | None = None,
    gradient_accumulation_steps: int = 1,
    mesh: DeviceMesh | None = None,
    ema: ShadowWeights | None = None,
    **runtime: Any,
) -> OptimizersContainer:
    """Compose the container that `cfg` asks for over `model_parts`.

    The parts: `precision` (default: `build_precision(cfg)`), `gate` (a `TorchFTGate` when
    the job runs under torchft), the timing (in backward when `cfg.early_step_in_backward` or
    `container = "in_backward"`), and `max_norm` (`[training] max_norm`; None: no norm).

    Args:
        model_parts: the model parts to optimize.
        cfg: the `[optimizer]` section.
        precision: the precision part the model was cast with.
        gate: whether steps commit (None: always).
        max_norm: clip the global gradient norm in `step()`; 0 only measures it.
        gradient_accumulation_steps: micro-batches per step (the in-backward timing counts).
        mesh: the job's named DeviceMesh (dims pp, dp_replicate, dp_shard, tp); the global
            norm counts every gradient element once over it. None: one stage over the world.
        ema: an EMA of the weights to keep as container state (`components.ema.build_ema`).
        **runtime: runtime objects a third-party container needs.
    """
    check_names(cfg)
    device = _device(model_parts)
    dtensor = any(isinstance(p, DTensor) for m in model_parts for p in m.parameters())
    sharded = is_sharded(model_parts)
    cls, kwargs = resolve_optimizer(cfg)
    refuse_on_shards(cls, cfg.name, "[optimizer]", sharded)
    kwargs |= implementation_kwargs(cls, cfg.implementation, device, "[optimizer]", dtensor)
    if note := slower_than_compiled(cls, kwargs, device):
        logger.info(note)
    try:
        return _CONTAINERS[cfg.container](
            list(model_parts),
            cls,
            kwargs,
            param_groups=_rules(cfg, cls, kwargs, device, dtensor, sharded),
            precision=precision if precision is not None else build_precision(cfg),
            gate=gate,
            timing=InBackward(gradient_accumulation_steps) if steps_in_backward(cfg) else None,
            max_norm=max_norm,
            mesh=mesh,
            ema=ema,
            **runtime,
        )
    except ConfigError:
        raise
    except ValueError as e:
        # The containers check model against config (patterns, ownership, compositions).
        # A message that names its own section (e.g. [mixed_precision]) keeps it alone.
        raise ConfigError(str(e) if str(e).startswith("[") else f"[optimizer] {e}") from e


def _build_default(
    model_parts: list[nn.Module],
    optimizer_cls: type[Optimizer],
    optimizer_kwargs: dict[str, Any],
    *,
    param_groups: Sequence[ParamGroupRule],
    precision: Precision,
    gate: Gate | None,
    timing: Timing | None,
    max_norm: float | None,
    mesh: DeviceMesh | None,
    ema: ShadowWeights | None,
) -> OptimizersContainer:
    # Master weights get the class that also offers offload() and the scaler's figures.
    container = (
        MixedPrecisionOptimizersContainer
        if isinstance(precision, MasterWeights)
        else OptimizersContainer
    )
    return container(
        model_parts,
        optimizer_cls,
        optimizer_kwargs,
        param_groups=param_groups,
        precision=precision,
        gate=gate,
        timing=timing,
        max_norm=max_norm,
        mesh=mesh,
        ema=ema,
    )


def _build_fault_tolerant(
    model_parts: list[nn.Module],
    optimizer_cls: type[Optimizer],
    optimizer_kwargs: dict[str, Any],
    *,
    gate: Gate | None,
    **parts: Any,
) -> OptimizersContainer:
    if not isinstance(gate, TorchFTGate | DiLoCoGate):
        raise ConfigError(
            "[optimizer] container = 'fault_tolerant': needs a torchft manager; set "
            "[fault_tolerance] enable = true (the job builder then makes one)"
        )
    return _build_default(model_parts, optimizer_cls, optimizer_kwargs, gate=gate, **parts)


# Every built-in name is one composition of parts: the name picks the precision
# (`build_precision`) or the timing (`build_optimizers`); the gate comes from the job.
register_container("default", _build_default)
register_container("in_backward", _build_default)
register_container("mixed_precision", _build_default)
register_container("fault_tolerant", _build_fault_tolerant)
