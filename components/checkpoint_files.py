"""The files of DCP checkpoints on disk: which `step-N` folders exist and whether one is intact.

A `step-N` folder only appears once its save finished, so one that is damaged now (a file
removed, truncated, overwritten; a folder copied in part) is reported by name with the fix,
never skipped for an older step: a silent fallback would train on from the wrong state.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from config import ConfigError

__all__ = [
    "Damaged",
    "agree_across_ranks",
    "checkpoint_steps",
    "damaged_checkpoint_error",
    "stale_saves",
    "strays",
    "verify",
]

# Only the names a save writes: `step-040` (a copy, a typo) is not step 40, and taking it for
# one would resume from it and overwrite the newer real steps.
_STEP_DIR = re.compile(r"step-(0|[1-9][0-9]*)")
_OURS = re.compile(r"step-(0|[1-9][0-9]*)(\.tmp|\.old)?")


def checkpoint_steps(folder: Path) -> dict[int, Path]:
    """Every published `step-N` folder under `folder` (not `step-N.tmp`, not `step-040`), by
    step."""
    found = {}
    if folder.is_dir():
        for path in folder.iterdir():
            match = _STEP_DIR.fullmatch(path.name)
            if match and path.is_dir():
                found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def strays(folder: Path) -> list[str]:
    """Names under `folder` that look like checkpoints but are no name a save writes
    (`step-040`, `step-7.bak`): never loaded, written over or deleted."""
    if not folder.is_dir():
        return []
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.name.startswith("step-") and not _OURS.fullmatch(p.name)
    )


def stale_saves(folder: Path) -> list[Path]:
    """`step-N.tmp` and `step-N.old` under `folder`: what a run stopped while saving leaves."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if (m := _OURS.fullmatch(p.name)) and m.group(2))


class Damaged(Exception):
    """One thing wrong with a checkpoint folder: the file (empty: the folder) and what."""

    def __init__(self, file: str, problem: str) -> None:
        super().__init__(f"{file or 'the folder'} {problem}")
        self.file, self.problem = file, problem


def verify(path: Path) -> Metadata:
    """The checkpoint's metadata, once every file it references is there and long enough.

    Only sizes are checked (a stat per file), so this costs nothing next to the load.

    Raises:
        Damaged: the first problem found.
    """
    if not any(path.iterdir()):
        raise Damaged("", "is empty (no .metadata, no .distcp files)")
    if not (path / ".metadata").is_file():
        raise Damaged(".metadata", "is missing (a save writes it last; files were removed)")
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # a pickle of garbage raises any of a dozen types
        raise Damaged(".metadata", f"is unreadable ({type(e).__name__}: {e})") from None
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(metadata, Metadata) or not isinstance(storage, dict):
        raise Damaged(".metadata", "is not DCP checkpoint metadata")
    # Each entry is a byte range (offset, length) of one .distcp file.
    needed: dict[str, int] = {}
    for info in storage.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            raise Damaged(name, "is missing (the .metadata references it)") from None
        if size < end:
            raise Damaged(name, f"is truncated: {size} bytes, the .metadata needs {end}")
    return metadata


def _intact(path: Path) -> bool:
    try:
        verify(path)
    except Damaged:
        return False
    return True


def damaged_checkpoint_error(step: int, damage: Damaged, found: dict[int, Path]) -> ConfigError:
    """The one line for a damaged `step-N` about to be loaded: folder, file, the intact steps."""
    path = found[step]
    intact = [s for s, p in found.items() if s != step and _intact(p)]
    message = (
        f"[checkpoint] {path} is damaged: {damage}; nothing was loaded or changed. Restore "
        f"{path.name} or move it out of {path.parent}"
    )
    if not intact:
        return ConfigError(f"{message} (no intact checkpoint there: the run would start over)")
    best = max(intact)
    fix = f"resume the newest intact step with [checkpoint] load_step = {best}"
    if any(s > best for s in found):
        fix += " and set_aside_newer = true (moves the newer steps aside)"
    return ConfigError(f"{message}, or {fix}; intact: {intact}")


def agree_across_ranks(
    any_rank: tuple[set[str], ...], every_rank: tuple[set[str], ...]
) -> tuple[tuple[set[str], ...], tuple[set[str], ...]]:
    """Key sets that every rank then sees alike: each of `any_rank` holds what some rank
    found (missing, reshaped), each of `every_rank` what all ranks found (a saved key is
    unexpected only if no rank takes it: a pipeline rank holds only its stages' keys)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return any_rank, every_rank
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, (any_rank, every_rank))
    union = tuple(set().union(*(v[0][i] for v in views)) for i in range(len(any_rank)))
    inter = tuple(set.intersection(*(v[1][i] for v in views)) for i in range(len(every_rank)))
    return union, inter
