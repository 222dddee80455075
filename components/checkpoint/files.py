"""The files of DCP checkpoints on disk: which `step-N` folders exist, whether one is intact and
fits the job, and what a stopped save left.

A `step-N` folder only appears once its save finished, so one that is damaged now (a file
removed, truncated, overwritten; a folder copied in part) is reported by name with the fix,
never skipped for an older step: a silent fallback would train on from the wrong state. Each
save records a checksum of every file it wrote (`CHECKSUMS`, XXH3 from `xxhash`: ~15 GB/s,
as fast as crc32c and 4x zlib's crc32 on this project's machine) before it is published, so
bytes changed in place are caught too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from config import ConfigError
from containers import OptimizersContainer
from containers.outer import OtherFragments
from containers.state.flat import OtherOptimizerState, describe_keys

__all__ = [
    "CHECKSUMS",
    "MODEL_SETTINGS",
    "Damaged",
    "agree_across_ranks",
    "changed_model_settings",
    "check_matches",
    "checkpoint_steps",
    "clear_stale",
    "damaged_checkpoint_error",
    "describe",
    "load_refusal",
    "model_settings_file",
    "refuse_strangers",
    "resume_instead",
    "unreadable",
    "verified",
    "verify",
    "write_checksums",
]

logger = logging.getLogger(__name__)

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


def clear_stale(folder: Path, owned: bool) -> None:
    """Remove the `step-N.tmp` (and `step-N.old`) folders a run stopped while saving left, if
    `owned`: this run holds the folder's lock, so whoever wrote them is dead; otherwise leave
    them (the writer may be live). Warn once about names a save never writes (`step-040`,
    `step-7.bak`): they are never loaded, written over or deleted."""
    names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if foreign := [n for n in names if n.startswith("step-") and not _OURS.fullmatch(n)]:
        logger.warning(
            "ignoring %s in %s: not checkpoint names (a save writes step-<N>, N without "
            "leading zeros); never loaded, written over or deleted",
            ", ".join(foreign),
            folder,
        )
    stale = [n for n in names if (m := _OURS.fullmatch(n)) and m.group(2) and _folder(folder / n)]
    if stale and not owned:
        logger.warning(
            "left %s in %s alone: this run holds no lock on the folder, so the run that wrote "
            "it may be live",
            ", ".join(stale),
            folder,
        )
        return
    for name in stale:
        try:
            shutil.rmtree(folder / name)
        except OSError as e:
            logger.warning("could not remove %s, left by a stopped save: %s", folder / name, e)
        else:
            logger.warning("removed %s, left by a run stopped while saving", folder / name)


def refuse_strangers(folder: Path, found: dict[int, Path], step: int) -> None:
    """Refuse to start where a name a save writes holds no checkpoint of ours, which a save,
    clean-up or rotation would rename or delete: a file or link under any such name (`step-N`,
    `step-N.tmp`, `step-N.old`), or a `step-N` folder older than `step` (the one to load; -1:
    none) without `.metadata` (a save writes it before the folder takes its name).

    Raises:
        ConfigError: naming each, before anything is loaded or changed.
    """
    names = [p for p in folder.iterdir() if _OURS.fullmatch(p.name) and not _folder(p)]
    names += [p for s, p in found.items() if s < step and not (p / ".metadata").is_file()]
    if names:
        what = ", ".join(f"{p} ({_kind(p)})" for p in sorted(names))
        raise ConfigError(
            f"[checkpoint] {what}: not a checkpoint, under a name a save writes, so a save "
            "would rename or delete it; nothing was changed. Move or rename it, or point "
            "[checkpoint] folder elsewhere"
        )


def _kind(path: Path) -> str:
    """What sits under a checkpoint's name, for `refuse_strangers`' line."""
    if path.is_symlink():
        return "a link"
    return "a folder without .metadata" if path.is_dir() else "a file"


def _folder(path: Path) -> bool:
    """A folder itself, not a file or a link (which `rmtree` and `os.replace` treat apart)."""
    return path.is_dir() and not path.is_symlink()


class Damaged(Exception):
    """One thing wrong with a checkpoint folder: the file (empty: the folder) and what."""

    def __init__(self, file: str, problem: str) -> None:
        super().__init__(f"{file or 'the folder'} {problem}")
        self.file, self.problem = file, problem


CHECKSUMS = ".checksums"
"""A checkpoint's record of its files: `{"xxh3_64": {file name: hex digest}}` (JSON)."""


def _digest(path: Path) -> str:
    """The XXH3-64 digest of a file, hashed from a read-only map (no copy of its bytes), or
    read in chunks where the file system maps none."""
    h = xxhash.xxh3_64()
    with path.open("rb") as f:
        if not os.fstat(f.fileno()).st_size:
            return h.hexdigest()
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                h.update(mapped)
        except (OSError, ValueError):
            h.reset()
            f.seek(0)
            while chunk := f.read(8 << 20):
                h.update(chunk)
    return h.hexdigest()


def _hasher(name: str, world: int) -> int:
    """The rank that hashes file `name` of a checkpoint, when saving and when verifying: the
    one that wrote it (DCP's `__<rank>_<n>.distcp`, its pages likely still in that rank's
    cache), rank 0 for the rest."""
    writer = re.match(r"__(\d+)_", name)
    return int(writer[1]) % world if writer else 0


def write_checksums(folder: Path, shared: bool = False, also: dict[str, str] | None = None) -> None:
    """Record a checksum of every file of a saved checkpoint `folder` (before it is published:
    a published checkpoint always has its record).

    Args:
        folder: the saved checkpoint, not yet published.
        shared: every rank of the job calls this at once: each hashes the files it wrote
            (`__<rank>_*`), rank 0 writes the record, and a failure on any rank (a full
            disk, an unreadable file) is raised on every rank.
        also: files (name -> text) rank 0 writes first, recorded with the rest.
    """
    world, rank = (dist.get_world_size(), dist.get_rank()) if shared else (1, 0)
    error: Exception | None = None
    sums: dict[str, str] = {}
    try:
        if rank == 0:
            for name, text in (also or {}).items():
                (folder / name).write_text(text)
        for p in sorted(folder.iterdir()):
            if _hasher(p.name, world) == rank and p.is_file() and p.name != CHECKSUMS:
                sums[p.name] = _digest(p)
    except Exception as e:  # (any: the other ranks must hear of it, not wait)
        error = e if isinstance(e, OSError) else RuntimeError(f"{type(e).__name__}: {e}")
    if world > 1:
        views: list[Any] = [None] * world
        dist.all_gather_object(views, (sums, error))
        sums = {name: digest for share, _ in views for name, digest in share.items()}
        error = next((e for _, e in views if e is not None), None)
    if error is None and rank == 0:
        tmp = folder / f"{CHECKSUMS}.tmp"
        try:
            with tmp.open("w") as f:
                json.dump({"xxh3_64": dict(sorted(sums.items()))}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, folder / CHECKSUMS)
        except OSError as e:
            error = e
    if world > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise error


MODEL_SETTINGS = ".model.json"
"""The settings of the model a checkpoint holds (JSON): its family, flavor and arguments."""


def model_settings_file(settings: dict[str, Any]) -> dict[str, str]:
    """The file recording the model's `settings` in a checkpoint (for `write_checksums`)."""
    return {MODEL_SETTINGS: json.dumps(settings, sort_keys=True)}


def changed_model_settings(path: Path, ours: dict[str, Any]) -> list[str]:
    """`setting saved -> ours` for each model setting of checkpoint `path` that differs from
    `ours` (none for a checkpoint that records none: saved before they were recorded)."""
    try:
        saved = json.loads((path / MODEL_SETTINGS).read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise Damaged(MODEL_SETTINGS, f"is unreadable ({type(e).__name__}: {e})") from None
    ours = json.loads(json.dumps(ours))  # (tuples as JSON holds them)
    return [
        f"{key} {saved.get(key, '(unset)')!r} -> {ours.get(key, '(unset)')!r}"
        for key in sorted(saved.keys() | ours.keys())
        if saved.get(key) != ours.get(key)
    ]


def verified(path: Path) -> bool:
    """Whether the checkpoint records checksums (older ones do not: loaded unverified)."""
    return (path / CHECKSUMS).is_file()


def verify(path: Path, checksums: bool = True, shared: bool = False) -> Metadata:
    """The checkpoint's metadata, once every file it references is there and long enough and
    every file it recorded still has its checksum (a checkpoint without a record, or not
    `checksums`: sizes only, a stat per file). `shared`: every rank of the job calls this at
    once, and each hashes its share of the files (the world agrees on the first problem).

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
    if checksums and verified(path):
        _check_sums(path, shared and dist.is_initialized() and dist.get_world_size() > 1)
    return metadata


def _check_sums(path: Path, shared: bool) -> None:
    try:
        sums = json.loads((path / CHECKSUMS).read_text())["xxh3_64"]
    except Exception as e:  # any damage to the record itself
        raise Damaged(CHECKSUMS, f"is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(sums, dict):
        raise Damaged(CHECKSUMS, "is not a checksum record (edited or damaged)")
    files = sorted(sums.items())
    if shared:
        world, rank = dist.get_world_size(), dist.get_rank()
        files = [(name, digest) for name, digest in files if _hasher(name, world) == rank]
    found = next((damage for damage in map(_checked, [path] * len(files), files) if damage), None)
    if shared:
        views: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(views, found)
        found = min((v for v in views if v is not None), default=None)
    if found is not None:
        raise Damaged(*found)


def _checked(path: Path, entry: tuple[str, str]) -> tuple[str, str] | None:
    """(file, problem) if the recorded `entry` (file, digest) no longer holds, else None."""
    name, want = entry
    file = path / name
    if not file.is_file():
        return name, f"is missing (its checksum is in {CHECKSUMS})"
    try:  # (a rank's own problem becomes the world's answer, never a rank left behind)
        digest = _digest(file)
    except OSError as e:
        return name, f"cannot be read ({type(e).__name__}: {e})"
    if digest != want:
        return name, "does not match its checksum (changed in place since its save)"
    return None


def describe(error: BaseException) -> str:
    """`error` in a few words for a one-line message: `rank 1: OSError: [Errno 28] ...`
    (the first failed rank's first line, where DCP gathered a traceback per rank)."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (failure, _) = min(error.failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {describe(failure)}"
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def unreadable(error: CheckpointException) -> Damaged:
    """A failed DCP load of a folder that `verify` passed, as its damage: files of the right
    sizes that do not hold what was saved (overwritten in place)."""
    return Damaged("", f"holds values that cannot be read ({describe(error)})")


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
    message = resume_instead(message, max(intact, default=None), found, "intact")
    return ConfigError(f"{message}; intact: {intact}" if intact else message)


def resume_instead(message: str, best: int | None, found: dict[int, Path], usable: str) -> str:
    """`message` (a refused `step-N`), then the other fix: resume `best`, the newest `usable`
    step, setting the newer ones aside; None: there is none."""
    if best is None:
        return f"{message} (no {usable} checkpoint there: the run would start over)"
    fix = f"resume the newest {usable} step with [checkpoint] load_step = {best}"
    if any(s > best for s in found):
        fix += " and set_aside_newer = true (moves the newer steps aside)"
    return f"{message}, or {fix}"


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


@contextlib.contextmanager
def forgetting_on_failure(states: dict[str, Stateful]) -> Iterator[None]:
    """A load's scope: if it fails, the containers among `states` forget the templates that
    `check_checkpoint_keys` fitted for it, so they are as they were (an EMA kept)."""
    try:
        yield
    except BaseException:
        for state in states.values():
            if isinstance(state, OptimizersContainer):
                state.forget_checkpoint_keys()
        raise


def check_matches(states: dict[str, Stateful], path: Path, metadata: Metadata) -> None:
    """Refuse a checkpoint whose keys or shapes differ, before anything is loaded."""
    saved = metadata.state_dict_metadata
    forms = []  # what each container's load converts (8-bit codes <-> tensors)
    for name, state in states.items():
        # A container says in its own words when the optimizer state is of another layout
        # (AdamW's for SGD): clearer than the key listing below.
        if isinstance(state, OptimizersContainer):
            keys = {
                k[len(name) + 1 :]: saved_dtype(v)
                for k, v in saved.items()
                if k.startswith(f"{name}.")
            }
            try:
                forms.append(state.check_checkpoint_keys(keys))
            except ValueError as e:
                other = isinstance(e, OtherOptimizerState)
                fix = "[optimizer] name and its settings pick the optimizer; " if other else ""
                raise _refused(path, e, fix) from None
    ours, _ = flatten_state_dict({k: v.state_dict() for k, v in states.items()})
    missing, unexpected = ours.keys() - saved.keys(), saved.keys() - ours.keys()
    reshaped = {
        f"{k}: checkpoint {tuple(saved[k].size)}, model {tuple(v.shape)}"
        for k, v in ours.items()
        if k in saved
        and isinstance(v, torch.Tensor)
        and isinstance(saved[k], TensorStorageMetadata)
        and tuple(saved[k].size) != tuple(v.shape)
    }
    # Every rank sees the same verdict and stops together.
    (missing, reshaped), (unexpected,) = agree_across_ranks((missing, reshaped), (unexpected,))
    if missing or unexpected or reshaped:
        raise ConfigError(
            f"[checkpoint] checkpoint {path} does not match this job (another model or "
            "config? point folder elsewhere): "
            f"missing keys {describe_keys(missing)}; unexpected keys "
            f"{describe_keys(unexpected)}; shape mismatches {describe_keys(reshaped)}"
        )
    if converted := "; ".join(filter(None, [dtype_changes(ours, saved), *forms])):
        logger.info("checkpoint %s: converted on load: %s", path, converted)


def load_refusal(path: Path, error: ValueError) -> ConfigError:
    """The one line for a checkpoint refused while it loads, for values the key check cannot
    see (DiLoCo's fragments; the data position's seq_len says its own)."""
    if isinstance(error, ConfigError):
        return error
    if isinstance(error, OtherFragments):
        return ConfigError(
            f"[fault_tolerance] num_fragments = {error.configured}: the checkpoint {path} was "
            f"trained with num_fragments = {error.saved} (each parameter keeps its fragment's "
            f"sync schedule); resume with --fault_tolerance.num_fragments {error.saved}, or "
            "start a new dump folder"
        )
    return _refused(path, error)


def _refused(path: Path, error: ValueError, fix: str = "") -> ConfigError:
    return ConfigError(
        f"[checkpoint] checkpoint {path}: {error} ({fix}another [job] dump_folder starts over)"
    )


def dtype_changes(ours: dict[str, Any], saved: dict[str, Any]) -> str:
    """What loading `saved` (a checkpoint's metadata) into `ours` converts, by state name:
    e.g. ``exp_avg, exp_avg_sq float32 -> bfloat16 (24 tensors)``; "" if nothing."""
    names: dict[tuple[torch.dtype, torch.dtype], set[str]] = {}
    counts: dict[tuple[torch.dtype, torch.dtype], int] = {}
    for key, value in ours.items():
        meta = saved.get(key)
        if not isinstance(value, torch.Tensor) or not isinstance(meta, TensorStorageMetadata):
            continue
        if (was := meta.properties.dtype) != value.dtype:
            pair = (was, value.dtype)
            names.setdefault(pair, set()).add(key.rsplit(".", 1)[-1])
            counts[pair] = counts.get(pair, 0) + 1
    return "; ".join(
        f"{', '.join(sorted(names[pair]))} {_dtype(pair[0])} -> {_dtype(pair[1])} "
        f"({counts[pair]} tensors)"
        for pair in names
    )


def saved_dtype(meta: Any) -> torch.dtype | None:
    """A checkpoint's entry's dtype (None: not a tensor)."""
    return meta.properties.dtype if isinstance(meta, TensorStorageMetadata) else None


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
