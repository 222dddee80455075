"""Bounded waits: the `[comm]` timeouts of the process group, and one line when one expires.

`init_timeout_seconds` holds from the start of the process group until the first applied
step (start-up, sharding, checkpoint load and the first step may be slow);
`train_timeout_after_first_step` then lowers the default group's timeout to
`train_timeout_seconds`. A collective that gets no answer in time raises on the ranks still
running; `collective_failure` turns that into one line naming the collective (from torch's
flight recorder) and `speak_once` has it said by the rank where the problem is.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from config import Comm as CommConfig

__all__ = [
    "CollectiveFailure",
    "collective_failure",
    "enable_flight_recorder",
    "init_timeout",
    "set_train_timeout",
    "speak_once",
    "train_timeout_after_first_step",
]

logger = logging.getLogger(__name__)

PEER_GRACE_S = 10.0
"""How long a rank that is probably not the root cause waits for a peer's line before it
speaks itself (torchrun ends it sooner: its agent notices a failed worker within 0.1 s)."""

_GLOO_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def enable_flight_recorder(cfg: CommConfig) -> None:
    """Have torch record the collectives of the process groups created from now on."""
    if cfg.trace_buf_size > 0:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(cfg.trace_buf_size))


def init_timeout(cfg: CommConfig) -> timedelta:
    """The timeout to start the process group with: `[comm] init_timeout_seconds`."""
    return timedelta(seconds=cfg.init_timeout_seconds)


def set_train_timeout(cfg: CommConfig) -> None:
    """Set the default process group's timeout to `[comm] train_timeout_seconds` (no-op
    without a process group)."""
    if dist.is_initialized():
        timeout = timedelta(seconds=cfg.train_timeout_seconds)
        dist.distributed_c10d._set_pg_timeout(timeout, None)


def train_timeout_after_first_step(
    optimizers: torch.optim.Optimizer, cfg: CommConfig
) -> RemovableHandle:
    """Register a step post-hook on `optimizers` that calls `set_train_timeout(cfg)` after the
    first applied step and then removes itself: the training loop stays unaware of it."""
    handle: RemovableHandle

    def after_first_step(*_: object) -> None:
        set_train_timeout(cfg)
        handle.remove()

    handle = optimizers.register_step_post_hook(after_first_step)
    return handle


def _last_collective() -> str | None:
    """The newest collective torch's flight recorder holds, e.g. "gloo:all_gather #12 (input
    sizes [[4096]])"; None when it records nothing."""
    try:
        dump = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=True))
        entry = dump["entries"][-1]
    except Exception:  # recorder off, unavailable in this build, or nothing recorded yet
        return None
    return (
        f"{entry['profiling_name']} #{entry['collective_seq_id']} "
        f"(input sizes {entry['input_sizes']}, timeout {entry['timeout_ms'] / 1000:g} s)"
    )


def _innermost_torch_call(exc: BaseException) -> str:
    """The innermost torch.distributed function in `exc`'s traceback (the recorder's fallback)."""
    frames = traceback.extract_tb(exc.__traceback__)
    names = [f.name for f in frames if f"torch{os.sep}distributed" in f.filename]
    return names[-1] if names else "a collective"


class CollectiveFailure(NamedTuple):
    line: str
    """What failed and why, in one line."""

    timed_out: bool
    """No answer in time (the rank saying it is the witness), rather than a peer that exited
    (whose own log has the cause)."""


def collective_failure(exc: BaseException) -> CollectiveFailure | None:
    """One line for `exc` if a collective raised it (no answer in time, or a peer gone);
    None for any other exception."""
    text = str(exc)
    gloo = "gloo" in text and ("Timed out" in text or any(s in text for s in _GLOO_PEER_GONE))
    if not (gloo or isinstance(exc, dist.DistError)):
        return None
    what = _last_collective() or _innermost_torch_call(exc)
    detail = text.split("] ", 1)[-1].strip()  # drop gloo's source-file prefix
    # gloo says "Timed out"; the store a starting process group waits on, "wait timeout".
    timed_out = (
        "timed out" in text.lower()
        or "wait timeout" in text
        or isinstance(exc, (dist.DistBackendError, dist.DistStoreError))
    )
    if timed_out:
        why = "got no answer in time: a rank stopped responding (see its log, or its host)"
    else:
        why = "lost a peer: another rank exited first (its log has the cause)"
    return CollectiveFailure(f"collective {what} {why}; {detail}", timed_out)


def _a_peer_spoke(within_s: float) -> bool:
    """Whether another worker of this torchrun agent wrote its error file (the line of its
    failure, see `speak_once`) within `within_s` seconds."""
    own = os.environ.get("TORCHELASTIC_ERROR_FILE")
    deadline = time.monotonic() + within_s
    while True:
        # torchelastic gives each worker <run>/attempt_<n>/<local_rank>/error.json.
        if own and any(p != Path(own) for p in Path(own).parent.parent.glob("*/error.json")):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def speak_once(line: str, *, root_cause: bool) -> bool:
    """Log `line` at ERROR unless another rank already said what went wrong; returns whether
    this rank spoke.

    Under torchrun every rank usually meets the same problem (a bad config), or a rank only
    sees a consequence (a peer that hung up). Rank 0 speaks at once when `root_cause`; any
    other rank first waits up to `PEER_GRACE_S` for a peer's line and, if one came, stays
    silent and lets the peer exit first (torchrun ends the waiting ranks). A rank that speaks
    also writes the line to torchrun's error file, so torchrun's failure summary shows it as
    the root cause instead of a link.
    """
    alone = int(os.environ.get("WORLD_SIZE", "1")) == 1
    first = root_cause and int(os.environ.get("RANK", "0")) == 0
    if not (alone or first):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun's SIGTERM ends the wait
        if _a_peer_spoke(PEER_GRACE_S):
            # Exit after the peer: torchrun then ends this rank and shows the peer's exit
            # code (not a SIGTERM it sent because this rank exited first).
            time.sleep(PEER_GRACE_S)
            return False
    logger.error("%s", line)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            with open(error_file, "w") as f:
                # torchelastic's own format: its summary shows `py_callstack` as the cause.
                info = {"py_callstack": line, "timestamp": str(int(time.time()))}
                json.dump({"message": {"message": line, "extraInfo": info}}, f)
        except OSError:
            pass  # the summary then shows torch's link instead: nothing is lost
    return True
