"""Whether a checkpoint on disk holds only finite numbers, checked before anything is loaded.

A save never writes inf or NaN (`components.checkpoint.save`), so a checkpoint that holds some
was damaged or written elsewhere; resumed, a NaN weight skips every step and a NaN moment
trains NaN into the weights. The check reads the floating-point chunks as stored, each rank
a share of the bytes, so the model and optimizer stay as they are until it has passed; each
chunk costs one pass (its min and max: a NaN or inf shows in one of them, where a sum or a
norm would overflow on large finite values) and the ranks agree in one all-reduce.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from components.checkpoint.files import Damaged, describe, resume_instead, verify
from config import ConfigError

__all__ = ["all_finite", "collective_device", "first_nonfinite", "nonfinite_checkpoint_error"]


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether `tensor` (floating point) holds no inf or NaN: one pass, min and max together."""
    if not tensor.numel():
        return True
    if tensor.element_size() == 1:  # float8: no min/max kernels
        tensor = tensor.float()
    return bool(torch.stack(torch.aminmax(tensor)).isfinite().all())


def collective_device() -> str:
    """Where the tensors of a small collective live: nccl takes CUDA ones only."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


class _Check(DefaultLoadPlanner):
    """Reads each chunk into scratch memory and keeps only the keys of non-finite ones."""

    def __init__(self, metadata: Metadata) -> None:
        super().__init__()
        self.saved = metadata.state_dict_metadata
        self.bad: set[str] = set()

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        meta = self.saved[read_item.dest_index.fqn]
        assert isinstance(meta, TensorStorageMetadata)
        return torch.empty(read_item.lengths, dtype=meta.properties.dtype)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        if not all_finite(tensor):
            self.bad.add(read_item.dest_index.fqn)


def first_nonfinite(
    path: Path, metadata: Metadata, keys: Collection[str] | None = None
) -> str | None:
    """The first flat key (in the checkpoint's order) of `path` whose saved tensor holds inf
    or NaN, or None; only `keys` if given. A collective: every rank calls it and reads its
    share of the bytes.

    Raises:
        Damaged: on every rank, where any rank's share cannot be read (files of the right
            sizes overwritten in place).
    """
    order, reads, sizes = [], [], []
    for key, meta in metadata.state_dict_metadata.items():
        if (
            not isinstance(meta, TensorStorageMetadata)
            or not meta.properties.dtype.is_floating_point
            or (keys is not None and key not in keys)
        ):
            continue
        order.append(key)
        for i, chunk in enumerate(meta.chunks):
            index, zeros = MetadataIndex(key, chunk.offsets, i), torch.Size([0] * len(chunk.sizes))
            reads.append(ReadItem(LoadItemType.TENSOR, index, zeros, index, zeros, chunk.sizes))
            sizes.append(chunk.sizes.numel() * meta.properties.dtype.itemsize)
    spread = dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if spread else (0, 1)
    total, start, mine = max(sum(sizes), 1), 0, []
    for read, size in zip(reads, sizes, strict=True):  # contiguous shares of the bytes
        if start * world // total == rank:
            mine.append(read)
        start += size
    reader = dcp.FileSystemReader(path)
    reader.set_up_storage_reader(metadata, is_coordinator=rank == 0)
    check, failure = _Check(metadata), None
    try:
        reader.read_data(LoadPlan(mine), check).wait()
    except Exception as e:  # any unreadable byte: said as damage, agreed below
        failure = e
    # MIN of [first bad key, -failed]: the earliest key, and whether any rank failed.
    found = torch.tensor(
        [min(map(order.index, check.bad), default=len(order)), -(failure is not None)]
    )
    if spread:
        found = found.to(collective_device())
        dist.all_reduce(found, op=dist.ReduceOp.MIN)
    first, failed = (int(v) for v in found.tolist())
    if failed:
        where = f"rank {rank}: {describe(failure)}" if failure is not None else "on another rank"
        raise Damaged("", f"holds values that cannot be read ({where})")
    return order[first] if first < len(order) else None


def nonfinite_checkpoint_error(step: int, key: str, found: dict[int, Path]) -> ConfigError:
    """The one line for a `step-N` holding inf or NaN: the first key, and the newest intact
    and finite step to resume instead (the older ones are read until one is; a collective)."""
    path, best = found[step], None
    for other in sorted((s for s in found if s != step), reverse=True):
        try:
            if first_nonfinite(found[other], verify(found[other])) is None:
                best = other
                break
        except Damaged:
            continue
    message = (
        f"[checkpoint] {path} holds inf or NaN (first in {key}): a save never writes them, so "
        f"it was damaged or written elsewhere; nothing was loaded or changed. Move {path.name} "
        f"out of {path.parent}"
    )
    return ConfigError(resume_instead(message, best, found, "finite"))
