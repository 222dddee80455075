"""What a save checks before it writes and how a failed one ends: no non-finite value is ever
written, and a save that fails is said in one line (`SaveFailed`) with the partial
`step-N.tmp` removed and the older checkpoints left as they were. A full disk stops the run
(exit 1); anything else stops it only where the save was its last, and training goes on
otherwise (a later save may succeed: the steps trained are not thrown away).
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from components.checkpoint.files import describe
from components.checkpoint.finite import all_finite, collective_device

__all__ = [
    "Audit",
    "SaveFailed",
    "any_rank",
    "audit",
    "first_failure",
    "folder_bytes",
    "save_failed",
]

_FULL = {errno.ENOSPC, errno.EDQUOT}


class SaveFailed(Exception):
    """A save that could not be written, said in one line.

    Args:
        line: what failed and what is kept.
        stops: the run must stop (exit 1) whether or not it had more saves to make: the disk
            is full.
    """

    def __init__(self, line: str, stops: bool = True) -> None:
        super().__init__(line)
        self.stops = stops


@dataclass
class Audit:
    """What a save would write, agreed by every rank."""

    nonfinite: int
    """Floating-point tensors (local shards, summed over ranks) holding inf or NaN."""
    nbytes: int
    """Bytes of every rank's tensors: what the save needs at most (replicas counted each)."""
    examples: list[str] = field(default_factory=list)
    """A few of this rank's non-finite tensors, by key."""

    def refusal(self, step: int, folder: Path, kept: str) -> str:
        """The line for a save refused for non-finite values (`kept`: the run's checkpoints
        there, in words)."""
        return (
            f"step-{step} not saved: inf or NaN in {self.nonfinite} tensor shards "
            f"({', '.join(self.examples) or 'on other ranks'}); the checkpoints in {folder} "
            f"stay as they were: {kept}"
        )


@torch.no_grad()
def audit(state_dicts: dict[str, Any]) -> Audit:
    """Count the non-finite tensors and the bytes of `state_dicts` (each Stateful's
    `state_dict()`, by name: what the save writes), in one all-reduce over the world.

    A collective: every rank calls it at the same save.
    """
    flat, _ = flatten_state_dict(state_dicts)
    nonfinite, nbytes, examples = 0, 0, []
    for key, value in flat.items():
        if isinstance(value, DTensor):
            value = value.to_local()
        if not isinstance(value, torch.Tensor):
            continue
        nbytes += value.numel() * value.element_size()
        if value.is_floating_point() and not all_finite(value):
            nonfinite += 1
            if len(examples) < 3:
                examples.append(key)
    if dist.is_initialized() and dist.get_world_size() > 1:
        counts = torch.tensor([nonfinite, nbytes], dtype=torch.int64, device=collective_device())
        dist.all_reduce(counts)
        nonfinite, nbytes = (int(c) for c in counts.tolist())
    return Audit(nonfinite, nbytes, examples)


def any_rank(failed: bool) -> bool:
    """Whether `failed` holds on any rank (a collective where the world has several)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return failed
    flag = torch.tensor([int(failed)], device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def folder_bytes(path: Path) -> int:
    """Bytes of the files under `path` (0 if it is gone)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).stat().st_size
            except OSError:
                pass  # removed meanwhile
    return total


def _causes(error: BaseException) -> list[BaseException]:
    """`error`, what it was raised from or during, and the per-rank failures DCP gathered."""
    seen, todo = [], [error]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [failure for failure, _ in e.failures.values()]
    return seen


def out_of_space(error: BaseException, needed: int = 0, free: int | None = None) -> bool:
    """Whether `error` (a failed DCP save) came from a full disk or quota.

    torch's writer reports it as `unexpected pos A vs B`, raised during an `OSError` with
    `ENOSPC`, or with no `OSError` at all when its buffered writes came up short: then the
    save needed more than the `free` bytes there were before it (not the free bytes now: the
    first rank to see the failure removes the partial save).
    """
    causes = _causes(error)
    if any(isinstance(e, OSError) and e.errno in _FULL for e in causes):
        return True
    short = any("unexpected pos" in str(e) for e in causes)
    return short and free is not None and free < needed


def first_failure(failure: SaveFailed | None) -> SaveFailed | None:
    """The lowest failed rank's `failure`, on every rank (a collective where the world has
    several): every rank then stops, or trains on, alike."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return failure
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, None if failure is None else (str(failure), failure.stops))
    line, stops = next((v for v in views if v is not None), (None, False))
    return None if line is None else SaveFailed(line, stops)


def save_failed(
    folder: Path, step: int, error: BaseException, needed: int, free: int, kept: str
) -> SaveFailed:
    """The one line for a failed save of `step-N.tmp` in `folder`, the partial save removed:
    out of disk (`stops`), or anything else (the run may train on); `kept`: the run's
    checkpoints there, in words.

    DCP raises it on every rank once they all stopped writing, so any rank may remove the
    partial save: the first to see the failure does.
    """
    tmp = folder / f"step-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if not out_of_space(error, needed, free):
        return SaveFailed(
            f"[checkpoint] step-{step} not saved ({describe(error)}); the checkpoints in "
            f"{folder} stay as they were ({kept})",
            stops=False,
        )
    needs = (
        f"it needs {needed} bytes, {free} were free"
        if needed > free
        else f"the disk or a quota filled up ({free} bytes were free when it began)"
    )
    return SaveFailed(
        f"[checkpoint] out of disk space saving step-{step} in {folder}: {needs}; the "
        f"partial {tmp.name} was removed and the checkpoints there stay as they were "
        f"({kept}); free space or point [checkpoint] folder at a larger disk, "
        "then run the same command to resume"
    )
