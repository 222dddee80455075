"""One live run per folder: `run.lock` in the dump folder and in the checkpoint folder, each held
with `flock` for the run's life.

Two runs with different dump folders may name one checkpoint folder (by any path: the lock is
on the file, whatever symlink or relative path leads to it), so that folder has its own lock.

The kernel releases an `flock` when its holder dies (crash, SIGKILL, OOM), so a lock left by a
dead run is simply taken over; nothing has to judge whether a recorded pid still lives. The file
records the holder (pid, host, start time) so a refused run can name it. Rank 0 of each run (of
each replica group under torchft) takes the lock; the other ranks learn the outcome from it.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

import torch.distributed as dist

from config import ConfigError

__all__ = ["LOCK_NAME", "RunLock", "RunLocks", "holds", "lock_dump_folder", "release_held"]

logger = logging.getLogger(__name__)
LOCK_NAME = "run.lock"
# Filesystems without flock (some Lustre mounts): run unguarded rather than refuse to run.
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}
# The locks this process holds, by folder (resolved): only there is a `.tmp` provably dead.
_HELD: dict[Path, RunLock] = {}


def holds(folder: str | os.PathLike) -> bool:
    """Whether this process holds the run lock of `folder` (by any path that names it)."""
    return Path(folder).resolve() in _HELD


def _describe(record: str) -> str:
    """`pid P on host H, started T` from a lock file's record, or what is known of it."""
    try:
        holder = json.loads(record)
        said = f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}"
        return said + (f", dump folder {holder['dump_folder']}" if "dump_folder" in holder else "")
    except (ValueError, KeyError, TypeError):
        return "holder not recorded yet"


def release_held() -> None:
    """Release every run lock this process holds, newest first: for an exit that skips the
    interpreter's teardown (`os._exit`), where the atexit hooks that would release them never
    run."""
    for lock in reversed(list(_HELD.values())):
        lock.release()


class RunLock:
    """An exclusive `flock` on `folder/run.lock`, taken by `acquire`, kept until `release`.

    Args:
        folder: the dump folder (or the checkpoint folder); created if missing.
        key: the config key that names `folder`, for the messages.
        dump_folder: the run's dump folder, recorded so a refused run can name it.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        key: str = "[job] dump_folder",
        dump_folder: str | os.PathLike | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.key = key
        self.dump_folder = Path(dump_folder if dump_folder is not None else folder)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise ConfigError naming the folder and the live holder."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(
                f"{self.key}: {self.folder} is not writable ({e.strerror}); point "
                f"--{self._option} at a writable place"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in _NO_FLOCK:
                os.close(fd)
                logger.warning(
                    "cannot lock %s (%s): nothing stops a second run on this folder",
                    self.path,
                    e.strerror,
                )
                return
            holder = self._read_holder(fd)
            os.close(fd)
            raise ConfigError(
                f"{self.key}: {self.folder.resolve()} is in use by a live run ({holder}; lock "
                f"{self.path}); wait for it to end, stop it, or pick another --{self._option}"
            ) from None
        previous = os.pread(fd, 4096, 0).decode(errors="replace")
        if previous.strip():
            # A run that ends normally clears its record: this one crashed or was killed.
            logger.warning(
                "took over %s from a run that ended without releasing it (%s)",
                self.path,
                _describe(previous),
            )
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "dump_folder": str(self.dump_folder.resolve()),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd
        _HELD[self.folder.resolve()] = self
        # Any exit of the interpreter (an error included) clears the record; only a process
        # killed outright leaves it, which the next run reports when it takes over.
        atexit.register(self.release)

    @property
    def _option(self) -> str:
        """`job.dump_folder` for `[job] dump_folder`: the command-line spelling of the key."""
        section, name = self.key.strip("[").split("] ")
        return f"{section}.{name}"

    @staticmethod
    def _read_holder(fd: int) -> str:
        # The holder writes its record right after locking: give it a moment to land.
        for _ in range(20):
            record = os.pread(fd, 4096, 0).decode(errors="replace")
            if record.endswith("\n"):
                break
            time.sleep(0.05)
        return _describe(record)

    def release(self) -> None:
        """Clear the record and unlock (the file stays: deleting it would race a new holder)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        atexit.unregister(self.release)
        _HELD.pop(self.folder.resolve(), None)
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing the last descriptor releases the flock


class RunLocks:
    """The locks one run holds (its dump folder's, and its checkpoint folder's if elsewhere)."""

    def __init__(self, locks: list[RunLock]) -> None:
        self.locks = locks

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()


def _acquire_all(folder: str, checkpoint_folder: str | os.PathLike | None) -> RunLocks:
    locks = [RunLock(folder)]
    if (
        checkpoint_folder is not None
        and Path(checkpoint_folder).resolve() != Path(folder).resolve()
    ):
        locks.append(RunLock(checkpoint_folder, "[checkpoint] folder", dump_folder=folder))
    taken = RunLocks([])
    try:
        for lock in locks:
            lock.acquire()
            taken.locks.append(lock)
    except BaseException:
        taken.release()  # the dump folder stays free when the checkpoint folder is refused
        raise
    return taken


def lock_dump_folder(
    folder: str, checkpoint_folder: str | os.PathLike | None = None
) -> RunLocks | None:
    """Rank 0 takes the run lock of `folder` and of `checkpoint_folder` (None: no checkpoints);
    every rank raises the same ConfigError if one fails.

    Returns the locks on rank 0 (None on the other ranks). Call it before anything connects or
    writes, so a refused run leaves the live one untouched.
    """
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    locks, error = None, None
    if not distributed or dist.get_rank() == 0:
        try:
            locks = _acquire_all(folder, checkpoint_folder)
        except ConfigError as e:
            error = str(e)
    if distributed:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise ConfigError(error)
    return locks
