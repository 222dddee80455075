"""`python train.py --nproc_per_node N ...`: the ranks of one machine, started and stopped well.

torchrun works as well; this launcher adds what a preempted or mistaken run needs:
- a bad config is one line and exit 2, found before any rank starts;
- SIGTERM, SIGINT or SIGHUP goes to every rank, which finish their step, save and exit 0, and
  so does the launcher (torchrun exits 1 with a traceback whenever it is signalled); a second
  signal kills the ranks at once; one before the ranks are started ends the launcher with one
  line and exit 0. Ranks run in sessions of their own (as torchrun's), so a terminal's Ctrl-C
  or hang-up reaches them once, through the launcher, not twice;
- a rank that fails ends the others at once, and the launcher exits with its code;
- ranks exit when the launcher dies (`components.preemption.watch_parent`), even of SIGKILL;
- the ranks' TCPStore is the launcher's, listening before any rank starts (as torchrun's agent
  store), so no port is chosen first and bound later, which another process may take meanwhile
  (several jobs on one machine, e.g. the replica groups of a torchft job).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from types import FrameType

from components.preemption import LAUNCHER_ENV, STOP_SIGNALS, early_signal
from config import ConfigError

__all__ = ["launch", "split_nproc"]

logger = logging.getLogger(__name__)


def split_nproc(argv: list[str]) -> tuple[int | None, list[str]]:
    """`--nproc_per_node N` (or `=N`) taken out of `argv`: (N or None, the rest)."""
    rest, nproc = [], None
    args = iter(argv)
    for arg in args:
        if arg == "--nproc_per_node" or arg.startswith("--nproc_per_node="):
            value = arg.partition("=")[2] if "=" in arg else next(args, "")
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(
                    f"--nproc_per_node {value!r}: expected the number of ranks to start (>= 1)"
                )
            nproc = int(value)
        else:
            rest.append(arg)
    return nproc, rest


def launch(script: str, nproc: int, argv: list[str]) -> int:
    """Run `script argv` as `nproc` ranks on this machine; return the exit code for the run."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {
        **os.environ,
        LAUNCHER_ENV: str(os.getpid()),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the ranks connect to this process's store
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
    }
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N ranks must not oversubscribe
    ranks: list[subprocess.Popen] = []
    signals: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        signals.append(signum)
        for p in ranks:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL if len(signals) > 1 else signum)

    previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    if early := early_signal():  # came while the launcher itself started (imports, config)
        signals.append(early)
    try:
        for r in range(nproc):
            if signals:
                break
            env_r = {**env, "RANK": str(r), "LOCAL_RANK": str(r)}
            cmd = [sys.executable, script, *argv]
            ranks.append(subprocess.Popen(cmd, env=env_r, start_new_session=True))
        if len(ranks) < nproc:  # the started ones would wait for the others: end them
            for p in ranks:
                p.kill()
                p.wait()
            return _stopped_before_ranks(signal.Signals(signals[0]).name)
        while True:
            codes = [p.poll() for p in ranks]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                break
            time.sleep(0.05)
        exit_code = failed[0] if failed else 0
        if failed:
            # The others would wait in a collective for the failed rank: end them now.
            for p in ranks:
                if p.poll() is None:
                    p.kill()
        for p in ranks:
            p.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if len(signals) > 1:
        return 128 + signals[-1]
    return exit_code if exit_code >= 0 else 128 - exit_code  # killed by a signal: 128 + it


def _stopped_before_ranks(name: str) -> int:
    logger.warning(
        "stopped by %s before the ranks started: nothing trained, nothing saved; the same "
        "command starts the run",
        name,
    )
    return 0
