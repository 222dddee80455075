"""`build_optimizers`: config (and the job's runtime objects) into a container; the built-in
containers registered (in `components.optimizer.registry`, on import).
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from components.optimizer.registry import (
    CONTAINERS,
    LEAN,
    OPTIMIZERS,
    register_container,
    registered_containers,
    registered_optimizers,
    resolve_optimizer,
)
from components.optimizer.settings import (
    implementation_kwargs,
    is_sharded,
    refuse_on_shards,
    slower_than_compiled,
)
from config import ConfigError, ParamGroup, steps_in_backward
from config import MixedPrecision as MixedPrecisionConfig
from config import Optimizer as OptimizerConfig
from containers import (
    DiLoCo,
    Gate,
    InBackward,
    LeanAdam,
    LeanAdamW,
    MasterWeights,
    MixedPrecisionOptimizersContainer,
    OptimizersContainer,
    Outer,
    ParamGroupRule,
    Precision,
    ShadowWeights,
    Timing,
    TorchFTGate,
)
from containers.update.forms import CODED

__all__ = [
    "OptimizersBuilder",
    "build_optimizers",
    "build_precision",
    "check_names",
]

logger = logging.getLogger(__name__)


class OptimizersBuilder(Protocol):
    """The train spec's `build_optimizers_fn`: `build_optimizers` or a replacement."""

    def __call__(
        self,
        model_parts: Sequence[nn.Module],
        cfg: OptimizerConfig,
        *,
        precision: Precision | None = None,
        gate: Gate | None = None,
        outer: Sequence[Outer] = (),
        max_norm: float | None = None,
        gradient_accumulation_steps: int = 1,
        mesh: DeviceMesh | None = None,
        ema: ShadowWeights | None = None,
    ) -> OptimizersContainer: ...


def check_names(cfg: OptimizerConfig) -> None:
    """Raise `ConfigError` unless the container and every optimizer `cfg` names are
    registered (cheap: `build_job` checks it before any process group exists)."""
    if cfg.container not in CONTAINERS:
        raise ConfigError(
            f"[optimizer] container = {cfg.container!r}: unknown container; registered: "
            f"{', '.join(registered_containers())}"
        )
    resolve_optimizer(cfg)
    for i, group in enumerate(cfg.param_groups):
        if group.name is not None:
            where = f"[optimizer.param_groups[{i}]]"
            resolve_optimizer(_group_config(cfg, group, where), group.name, where)
    _refuse_unread_keys(cfg)


# Keys of `[optimizer]` the builder reads itself; every other key is a hyperparameter that some
# registered optimizer's factory turns into a keyword argument.
_BUILDER_KEYS = frozenset(
    {"name", "container", "implementation", "moment_dtype", "early_step_in_backward", "pattern"}
)


def _refuse_unread_keys(cfg: OptimizerConfig) -> None:
    """Refuse a hyperparameter set (not to its default) that no optimizer of the section reads,
    as keys of a feature that is off are refused (a silently ignored key is a wrong run): a
    section key counts as read where the section's optimizer or a param group's reads it, a
    group's key where its own optimizer does."""
    groups = [
        (group.name or cfg.name, _group_config(cfg, group, f"[optimizer.param_groups[{i}]]"))
        for i, group in enumerate(cfg.param_groups)
    ]
    users = [(cfg.name, cfg), *groups]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in _BUILDER_KEYS or f.name == "param_groups" or value == f.default:
            continue
        if not any(_reads(name, c, f.name) for name, c in users):
            _refuse_unread("[optimizer]", f.name, value, sorted({n for n, _ in users}))
    for i, (group, (name, group_cfg)) in enumerate(zip(cfg.param_groups, groups)):
        for f in dataclasses.fields(group):
            value = getattr(group, f.name)
            if f.name in _BUILDER_KEYS or value is None or _reads(name, group_cfg, f.name):
                continue
            _refuse_unread(f"[optimizer.param_groups[{i}]]", f.name, value, [name])


def _reads(name: str, cfg: OptimizerConfig, key: str) -> bool:
    """Whether optimizer `name`'s factory turns `key` into a keyword argument: another value
    of the key changes the arguments it gives (a factory that refuses it reads it too)."""
    value = getattr(cfg, key)
    if isinstance(value, bool):
        other: Any = not value
    elif isinstance(value, (int, float)):
        other = value / 2 + 1e-3 if isinstance(value, float) else value + 1
    elif value is None:
        other = 0.5
    else:  # a choice among names (Muon's): another of them
        choices = [c for c in _choices(type(cfg), key) if c != value]
        if not choices:
            return True
        other = choices[0]
    factory = OPTIMIZERS.get(name)
    if factory is None:
        return True  # (an unknown name is refused by name)
    try:
        return factory(cfg)[1] != factory(dataclasses.replace(cfg, **{key: other}))[1]
    except (ConfigError, ValueError, TypeError):
        return True


def _choices(cls: type, key: str) -> tuple[Any, ...]:
    """The values a `Literal` field `key` of dataclass `cls` allows (none for other types)."""
    hint = typing.get_type_hints(cls)[key]
    for arg in (hint, *typing.get_args(hint)):
        if typing.get_origin(arg) is typing.Literal:
            return typing.get_args(arg)
    return ()


def _refuse_unread(where: str, key: str, value: Any, names: list[str]) -> None:
    readers = [n for n in registered_optimizers() if _reads(n, OptimizerConfig(), key)]
    raise ConfigError(
        f"{where} {key} = {value!r}: {', '.join(names)} takes no {key}, so it would be ignored; "
        f"remove it, or use an optimizer that reads it ({', '.join(readers) or 'none'})"
    )


def _device(model_parts: Sequence[nn.Module]) -> torch.device:
    devices = {p.device for m in model_parts for p in m.parameters() if p.requires_grad}
    if len(devices) > 1:
        raise ValueError(f"trainable parameters span devices {sorted(map(str, devices))}")
    return next(iter(devices), torch.device("cpu"))


def build_precision(
    cfg: OptimizerConfig, mixed_precision: MixedPrecisionConfig | None = None
) -> Precision:
    """The precision of the container `cfg.container` names: the job casts the model with a
    `MasterWeights` (`cast_model`) before sharding, then hands it to `build_optimizers`."""
    if cfg.container == "mixed_precision":
        try:
            return MasterWeights(None if mixed_precision is None else mixed_precision.settings())
        except ValueError as e:
            raise ConfigError(str(e)) from e
    return Precision()


def cast_model(precision: Precision, model: nn.Module) -> nn.Module:
    """`model` with the parameter dtype `precision` steps: a `MasterWeights` casts it (before
    sharding, so FSDP2 shards the cast parameters); fp32 leaves it as it is."""
    return precision.cast_model(model) if isinstance(precision, MasterWeights) else model


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
        if LEAN.get(group_cls) is cls:  # a float32 group of a lean section: the same class
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
    factory = OPTIMIZERS.get(group.name or group_cfg.name)
    if group.moment_dtype is not None or group_cfg.moment_dtype not in CODED or factory is None:
        return group_cfg
    lean = dataclasses.replace(group_cfg, moment_dtype="bfloat16")
    cls, kwargs = factory(lean)
    if cls in (LeanAdam, LeanAdamW) or "moment_dtype" not in kwargs:
        return group_cfg  # codes, or no lean state at all (refused there)
    if say:
        logger.info(
            "%s %s keeps its state in bfloat16 ([optimizer] moment_dtype = %r: codes are "
            "Adam's and AdamW's moments)",
            where,
            cls.__name__,
            group_cfg.moment_dtype,
        )
    return lean


def build_optimizers(
    model_parts: Sequence[nn.Module],
    cfg: OptimizerConfig,
    *,
    precision: Precision | None = None,
    gate: Gate | None = None,
    outer: Sequence[Outer] = (),
    max_norm: float | None = None,
    gradient_accumulation_steps: int = 1,
    mesh: DeviceMesh | None = None,
    ema: ShadowWeights | None = None,
    **runtime: Any,
) -> OptimizersContainer:
    """Compose the container that `cfg` asks for over `model_parts`.

    The parts: `precision` (default: `build_precision(cfg)`), `gate` (a `TorchFTGate` when
    the job averages gradients under torchft), `outer` (a `DiLoCo` when it runs DiLoCo; the
    model family's own, e.g. MoE load balancing), the timing (in backward when
    `cfg.early_step_in_backward` or `container = "in_backward"`), and `max_norm` (`[training]
    max_norm`; None: no norm).

    Args:
        model_parts: the model parts to optimize.
        cfg: the `[optimizer]` section.
        precision: the precision part the model was cast with.
        gate: whether steps commit (None: always).
        outer: what follows each committed step, in order.
        max_norm: clip the global gradient norm in `step()`; 0 only measures it.
        gradient_accumulation_steps: micro-batches per step (the in-backward timing counts).
        mesh: the job's named DeviceMesh (dims pp, dp_replicate, dp_shard, tp); the global
            norm counts every gradient element once over it. None: one stage over the world.
        ema: an EMA of the weights to keep as container state (`components.ema_builder.build_ema`).
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
        return CONTAINERS[cfg.container](
            list(model_parts),
            cls,
            kwargs,
            param_groups=_rules(cfg, cls, kwargs, device, dtensor, sharded),
            precision=precision if precision is not None else build_precision(cfg),
            gate=gate,
            outer=outer,
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
    outer: Sequence[Outer],
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
        outer=outer,
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
    outer: Sequence[Outer],
    **parts: Any,
) -> OptimizersContainer:
    if not isinstance(gate, TorchFTGate) and not any(isinstance(o, DiLoCo) for o in outer):
        raise ConfigError(
            "[optimizer] container = 'fault_tolerant': needs a torchft manager; set "
            "[fault_tolerance] enable = true (the job builder then makes one)"
        )
    return _build_default(
        model_parts, optimizer_cls, optimizer_kwargs, gate=gate, outer=outer, **parts
    )


# Every built-in name is one composition of parts: the name picks the precision
# (`build_precision`) or the timing (`build_optimizers`); the gate and outer part come from
# the job.
register_container("default", _build_default)
register_container("in_backward", _build_default)
register_container("mixed_precision", _build_default)
register_container("fault_tolerant", _build_fault_tolerant)
