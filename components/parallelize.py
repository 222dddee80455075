"""Shard model parts with FSDP2 on a data-parallel DeviceMesh, whatever the model family."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

__all__ = ["shard_parts"]


def shard_parts(
    parts: list[nn.Module],
    mesh: DeviceMesh | None,
    units: Callable[[nn.Module], Iterable[nn.Module]],
) -> list[nn.Module]:
    """`fully_shard` each unit of each part, then the part itself, over `mesh`.

    Each unit is all-gathered and resharded on its own (e.g. a transformer block), so the
    whole part is never gathered at once; the part's own call picks up what no unit holds.

    Args:
        parts: the model parts, sharded in place.
        mesh: 1-D data-parallel mesh; None leaves the parts unsharded (one process).
        units: a part's modules to shard one by one, in forward order.

    Returns:
        `parts` (the same module objects).
    """
    if mesh is not None:
        for part in parts:
            for unit in units(part):
                fully_shard(unit, mesh=mesh)
            fully_shard(part, mesh=mesh)
    return parts
