"""RunLock: one live run per dump folder; a dead holder's lock is taken over."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys

import pytest

from components.run_lock import LOCK_NAME, RunLock, holds, lock_dump_folder, release_held
from config import ConfigError
from tests.harness.dist import REPO, run_ranks

HOLD = """
import sys, time
from components.run_lock import RunLock
RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_a_live_holder_is_named_and_a_dead_ones_lock_is_taken_over(tmp_path, caplog):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        live = rf"{tmp_path} is in use by a live run \(pid {holder.pid} on host "
        with pytest.raises(ConfigError, match=live + socket.gethostname()):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()  # SIGKILL: no release, the record stays behind
        holder.wait(timeout=30)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == holder.pid

    lock = RunLock(tmp_path)
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    assert f"ended without releasing it (pid {holder.pid} on host" in caplog.text
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] != holder.pid
    lock.release()  # a clean end leaves no record: the next run takes it without a warning
    caplog.clear()
    again = RunLock(tmp_path)
    again.acquire()
    again.release()
    assert "ended without releasing" not in caplog.text


def test_release_held_frees_every_lock_of_the_process(tmp_path):
    """What train.py's `exit_now` calls before `os._exit`, where no atexit hook runs."""
    dump, checkpoints = tmp_path / "dump", tmp_path / "checkpoints"
    locks = lock_dump_folder(str(dump), checkpoints)
    assert locks is not None and holds(dump) and holds(checkpoints)
    release_held()
    assert not holds(dump) and not holds(checkpoints)
    for folder in (dump, checkpoints):
        assert (folder / LOCK_NAME).read_text() == ""  # a clean end: no record left
        again = RunLock(folder)
        again.acquire()
        again.release()


def _try_lock(folder: str) -> str:
    try:
        lock_dump_folder(folder)
    except ConfigError as e:
        return str(e)
    return "locked"


def test_every_rank_of_a_refused_run_gets_the_same_error(tmp_path):
    held = RunLock(tmp_path)
    held.acquire()
    try:
        errors = run_ranks(2, _try_lock, str(tmp_path))
    finally:
        held.release()
    # Rank 1 never touched the file: it learned rank 0's outcome.
    assert errors[0] == errors[1] and f"{tmp_path} is in use by a live run" in errors[0]
