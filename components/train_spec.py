"""`TrainSpec`: the builders a model family plugs into `train.py`, and their registry.

Each builder takes its own config section, never the whole `JobConfig`, so a family's code
says what it reads. The built-in families (`BUILTINS`) are imported the first time a spec is
looked up, from the source tree itself, so a checkout on `PYTHONPATH` works without being
installed; third-party families register through the `optimizer_containers.train_specs`
entry points. No generic module imports a family.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import import_module
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import config
from components.lr_scheduler import LRSchedulersContainer, build_lr_schedulers
from components.optimizer import OptimizersBuilder, build_optimizers
from containers import OptimizersContainer

__all__ = [
    "BalancedLayersFinder",
    "ConfigValidator",
    "Dataloader",
    "DataloaderBuilder",
    "LRSchedulersBuilder",
    "LossBuilder",
    "LossFn",
    "ModelBuilder",
    "OptimizersBuilder",
    "Parallelizer",
    "TrainSpec",
    "get_train_spec",
    "register_train_spec",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Positional-only parameters: a builder may name its own arguments as it likes.


class ModelBuilder(Protocol):
    """`(cfg: [model]) -> model`, on CPU or meta; the caller seeds torch beforehand."""

    def __call__(self, cfg: config.Model, /) -> nn.Module: ...


class Parallelizer(Protocol):
    """`(model, cfg: [model], mesh, stages, *, shard_impl, mp_policy) -> this rank's model
    parts`: `model` split into `[model] num_parts` parts that keep their FQNs, the parts whose
    indices are in `stages` kept, parallelized over the job's named `mesh` (None: one process,
    unsharded), sharded by `shard_impl` (`[parallelism] data_parallel_shard_impl`, e.g.
    through `components.parallelize.shard_parts`), with FSDP2's `mp_policy` (from `[training]
    mixed_precision_param`/`_reduce`; passed only when one is set, so a family without mixed
    precision needs no such argument)."""

    def __call__(
        self,
        model: nn.Module,
        cfg: config.Model,
        mesh: DeviceMesh | None,
        stages: Sequence[int],
        /,
        *,
        shard_impl: config.ShardImpl = "fsdp2",
        mp_policy: MixedPrecisionPolicy | None = None,
    ) -> list[nn.Module]: ...


class LossBuilder(Protocol):
    """`(cfg: [training]) -> loss(outputs, labels)`."""

    def __call__(self, cfg: config.Training, /) -> LossFn: ...


@runtime_checkable
class Dataloader(Iterator[tuple[torch.Tensor, torch.Tensor]], Protocol):
    """An endless iterator of `(inputs, labels)` whose position is checkpointed."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None: ...


class DataloaderBuilder(Protocol):
    """`(cfg: [training], dp_rank, dp_world_size) -> this rank's Dataloader`."""

    def __call__(self, cfg: config.Training, dp_rank: int, dp_world_size: int, /) -> Dataloader: ...


class LRSchedulersBuilder(Protocol):
    """`(optimizers, cfg: [lr_scheduler], total_steps) -> LRSchedulersContainer`."""

    def __call__(
        self, optimizers: OptimizersContainer, cfg: config.LRScheduler, total_steps: int, /
    ) -> LRSchedulersContainer: ...


class BalancedLayersFinder(Protocol):
    """`(model_parts) -> {MoE layer FQN: (expert bias, token counts)}`: the buffers of the
    family's aux-loss-free load balancing (`containers.LoadBalance`, which the job builds with
    `[model] load_balance_coeff`): each layer adds its bias to the routing scores for the
    top-k selection and adds each forward's selections per expert to its counts."""

    def __call__(
        self, model_parts: Sequence[nn.Module], /
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]: ...


class ConfigValidator(Protocol):
    """`(cfg: the whole job config) -> None`, raising `config.ConfigError` (one line naming
    the key, the value and the fix) for what the family cannot run.

    The one builder that sees every section, since its rules cross them (e.g. `[training]
    seq_len` against the `[model] flavor`'s positions). `build_job` calls it before any process
    group or connection exists, so a bad config costs no start-up.
    """

    def __call__(self, cfg: config.JobConfig, /) -> None: ...


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """How to build each piece of a training job for one model family."""

    name: str
    """Key under which the spec is registered (`[model] name`)."""

    build_model_fn: ModelBuilder
    parallelize_fn: Parallelizer
    build_loss_fn: LossBuilder
    build_dataloader_fn: DataloaderBuilder
    build_lr_schedulers_fn: LRSchedulersBuilder = build_lr_schedulers
    build_optimizers_fn: OptimizersBuilder = build_optimizers
    balanced_layers_fn: BalancedLayersFinder | None = None
    """A mixture of experts' load-balanced layers; None: the family has none."""
    validate_config_fn: ConfigValidator | None = None


ENTRY_POINTS = "optimizer_containers.train_specs"
"""Entry-point group of third-party model families (in their own pyproject.toml)."""

BUILTINS = {"llama": "components.models.llama", "moe": "components.models.moe"}
"""The families of this repository: name -> the module that registers it when imported."""

_SPECS: dict[str, TrainSpec] = {}


def register_train_spec(spec: TrainSpec) -> None:
    """Add `spec` under `spec.name`; a name can be registered once."""
    if not isinstance(spec, TrainSpec):
        raise ValueError(f"register_train_spec({spec!r}): expected a TrainSpec")
    if spec.name in _SPECS:
        raise ValueError(f"train spec {spec.name!r} is already registered; pick another name")
    _SPECS[spec.name] = spec


def get_train_spec(name: str) -> TrainSpec:
    """The spec registered as `name`; a built-in family, or one installed under the
    entry-point group `optimizer_containers.train_specs`, is imported (and so registered) on
    first use. An unknown name imports the built-ins, so the error lists them."""
    if name in BUILTINS:
        import_module(BUILTINS[name])
    if name not in _SPECS:
        for entry in entry_points(group=ENTRY_POINTS):
            if entry.name == name:
                entry.load()
    if name not in _SPECS:
        for module in BUILTINS.values():
            import_module(module)
        known = ", ".join(sorted(_SPECS)) or "none"
        raise config.ConfigError(
            f"[model] name = {name!r}: unknown train spec; registered: {known}"
        )
    return _SPECS[name]
