"""How the llama family is cut into model parts and sharded."""

from __future__ import annotations

from collections.abc import Iterable

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from components.models.llama.model import Transformer, split_model
from components.parallelize import shard_parts
from config import Model as ModelConfig

__all__ = ["parallelize"]


def _blocks(part: nn.Module) -> Iterable[nn.Module]:
    return part.get_submodule("layers").children()


def parallelize(model: nn.Module, cfg: ModelConfig, mesh: DeviceMesh | None) -> list[nn.Module]:
    """`[model] num_parts` parts of `model`, each block and then each part sharded over `mesh`.

    Args:
        model: the whole llama `Transformer`.
        cfg: the `[model]` section (reads `num_parts`).
        mesh: 1-D data-parallel mesh; None leaves the parts unsharded (one process).
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"llama parallelize: expected a llama Transformer, got {type(model)}")
    parts: list[nn.Module] = list(split_model(model, cfg.num_parts))
    return shard_parts(parts, mesh, _blocks)
