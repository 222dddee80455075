"""Optimizers and containers from the `[optimizer]` config: `build_optimizers` (`build`), the
registries of optimizers and container variants (`registry`), and what each built-in takes
from the config (`settings`). Importing the package registers the built-ins.
"""

from components.optimizer.build import (
    OptimizersBuilder,
    build_optimizers,
    build_precision,
    cast_model,
    check_names,
)
from components.optimizer.registry import (
    CONTAINERS,
    LEAN,
    OPTIMIZERS,
    ContainerFactory,
    OptimizerFactory,
    register_container,
    register_optimizer,
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

__all__ = [
    "CONTAINERS",
    "LEAN",
    "OPTIMIZERS",
    "ContainerFactory",
    "OptimizerFactory",
    "OptimizersBuilder",
    "build_optimizers",
    "build_precision",
    "cast_model",
    "check_names",
    "implementation_kwargs",
    "is_sharded",
    "refuse_on_shards",
    "register_container",
    "register_optimizer",
    "registered_containers",
    "registered_optimizers",
    "resolve_optimizer",
    "slower_than_compiled",
]
