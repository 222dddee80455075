"""Split a model into parts and shard each with FSDP2 on a data-parallel DeviceMesh."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from components.models.llama.model import Transformer, split_model
from config import JobConfig

__all__ = ["parallelize"]


def parallelize(
    model: Transformer, job_config: JobConfig, mesh: DeviceMesh | None
) -> list[nn.Module]:
    """The model's parts, each block and then each part `fully_shard`ed over `mesh`.

    Args:
        model: the whole model.
        job_config: reads `[model] num_parts`.
        mesh: 1-D data-parallel mesh; None leaves the parts unsharded (one process).
    """
    parts = split_model(model, job_config.model.num_parts)
    if mesh is not None:
        for part in parts:
            for block in part.layers.values():
                fully_shard(block, mesh=mesh)
            fully_shard(part, mesh=mesh)
    return parts
