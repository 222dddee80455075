"""Stopping well: a signal ends the run at a step boundary; a dead launcher ends its workers.

A cluster sends SIGTERM (or a user SIGINT, or a closed terminal SIGHUP) some time before it
kills a job. `StopRequest` turns the first one into a flag that the trainer reads once per
step; the ranks agree on it inside a collective the step makes anyway, finish that step, save
and exit 0. A second signal exits at once. One that comes while the process starts (torch
imports for seconds) is recorded by `catch_early` and handed to `StopRequest`, so it too ends
the run in one line. `watch_parent` ends a worker whose launcher died (torchrun starts workers
in sessions of their own, so killing the launcher's process group does not reach them).

Standard library only: `components.startup_signals` imports this before torch.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

__all__ = [
    "LAUNCHER_ENV",
    "STOP_SIGNALS",
    "StopRequest",
    "catch_early",
    "early_signal",
    "watch_parent",
]

logger = logging.getLogger(__name__)

LAUNCHER_ENV = "OPTIMIZER_CONTAINERS_LAUNCHER"
"""Set in every rank that `components.launcher` starts (to the launcher's pid)."""

_LAUNCHED_BY = (LAUNCHER_ENV, "TORCHELASTIC_RUN_ID")
"""Environment variables a launcher sets in its ranks: only those watch their parent."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals that stop a run after a save: a scheduler's, Ctrl-C, a closed terminal."""

_early: list[signal.Signals] = []


def _record_early(signum: int, frame: FrameType | None) -> None:
    if _early:
        os._exit(128 + signum)  # asked twice: out now
    _early.append(signal.Signals(signum))


def catch_early() -> None:
    """Record a stop signal until `StopRequest` takes over, instead of dying of it."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _record_early)


def early_signal() -> signal.Signals | None:
    """The stop signal `catch_early` recorded, if any."""
    return _early[0] if _early else None


class StopRequest:
    """Catches `STOP_SIGNALS` for the life of the run; `requested` once one arrived (also one
    that `catch_early` recorded before). Once `arm`ed, a run that has not exited
    `grace_seconds` after the signal (a save, a quorum or a heal still running) says what it
    could not save and exits 1, before a scheduler's SIGKILL would end it unsaid."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = early_signal()
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        self._grace: tuple[float, Callable[[], str]] | None = None
        self._timer: threading.Timer | None = None

    def arm(self, grace_seconds: float, saved: Callable[[], str]) -> None:
        """From now, a signal gives the run `grace_seconds` to exit (counted from now for one
        that came before); `saved()` says what the newest checkpoint holds."""
        self._grace = (grace_seconds, saved)
        if self.signal is not None:
            self._start_timer()

    def _start_timer(self) -> None:
        if self._grace is None or self._timer is not None:
            return
        self._timer = threading.Timer(self._grace[0], self._expired)
        self._timer.daemon = True
        self._timer.start()

    def _expired(self) -> None:
        grace, saved = self._grace  # type: ignore[misc]
        logger.error(
            "stopped by %s %g s ago and still not exited ([training] stop_grace_seconds = %g: "
            "a save, a quorum or a heal still runs): %s; exiting now with 1",
            self.signal.name if self.signal else "a signal", grace, grace, saved(),
        )  # fmt: skip
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None:
            # Asked twice: the user wants out now, not after a save.
            os._exit(128 + signum)
        self.signal = signal.Signals(signum)
        self._start_timer()
        logger.warning(
            "received %s: stopping at the next micro-batch (its step dropped) or step, the "
            "last committed step saved; send it again to exit at once",
            self.signal.name,
        )

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def watch_parent(poll_seconds: float = 0.5) -> None:
    """Exit this process soon after its launcher dies (only under a launcher), also one that
    died before this ran (while the rank imported torch): train.py's launcher names its pid
    (`LAUNCHER_ENV`); under torchrun, which names none, the parent at this call is watched."""
    if not any(v in os.environ for v in _LAUNCHED_BY):
        return
    ours = os.environ.get(LAUNCHER_ENV, "")
    parent = int(ours) if ours.isdigit() else os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        logger.error("the launcher (pid %d) died: this worker stops too", parent)
        os._exit(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()
