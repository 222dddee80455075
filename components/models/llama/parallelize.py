"""How the llama family is cut into model parts (pipeline stages), tensor-parallelized and
sharded."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from components.models.llama.model import Transformer, split_model
from components.parallelize import replicate_rest, shard_parts
from config import Model as ModelConfig
from config import ShardImpl

__all__ = ["parallelize"]

# Megatron's split: q/k/v and the gate/up projections by columns (each rank keeps whole heads
# and a slice of the hidden units), the output projections by rows, so each block costs one
# all-reduce forward and one backward per sub-layer. Norms, embedding and head stay whole.
_BLOCK_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}


def _blocks(part: nn.Module) -> Iterable[nn.Module]:
    return part.get_submodule("layers").children()


def parallelize(
    model: nn.Module,
    cfg: ModelConfig,
    mesh: DeviceMesh | None,
    stages: Sequence[int],
    /,
    *,
    shard_impl: ShardImpl = "fsdp2",
    mp_policy: MixedPrecisionPolicy | None = None,
) -> list[nn.Module]:
    """This rank's model parts: `model` split into `[model] num_parts`, the parts `stages`
    kept; blocks tensor-parallel over the mesh's tp dim, then each block and part sharded over
    its data-parallel dims.

    Args:
        model: the whole llama `Transformer`.
        cfg: the `[model]` section (reads `num_parts`).
        mesh: the job's named mesh (`components.parallel_dims.MESH_DIMS`); None: one process.
        stages: indices of the parts this rank holds (all of them without pipelining).
        shard_impl: "fsdp2" (`fully_shard`) or "fsdp1" (`FullyShardedDataParallel`).
        mp_policy: FSDP2's mixed precision for every `fully_shard` (None: none).
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"llama parallelize: expected a llama Transformer, got {type(model)}")
    parts: list[nn.Module] = [
        part for i, part in enumerate(split_model(model, cfg.num_parts)) if i in stages
    ]
    if mesh is not None and mesh["tp"].size() > 1:
        for part in parts:
            for block in _blocks(part):
                parallelize_module(block, mesh["tp"], _BLOCK_PLAN)
            replicate_rest(part, mesh["tp"])
    return shard_parts(parts, mesh, _blocks, shard_impl, mp_policy)
