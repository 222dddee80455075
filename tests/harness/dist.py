"""Run a test body on N real gloo ranks, each in its own process, with bounded waits."""

from __future__ import annotations

import io
import os
import queue
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, results: Any, fn: Callable, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
        )
        try:
            # Bytes, not tensors: torch's queue would share tensor memory with a process that
            # exits right after putting them.
            buf = io.BytesIO()
            torch.save(fn(*args), buf)
            results.put((rank, True, buf.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 180.0) -> list[Any]:
    """Run `fn(*args)` on `world_size` gloo ranks and return each rank's result, by rank.

    `fn` must be importable (module level). Any rank's exception, a rank that dies, or the
    timeout fails the call with the ranks' tracebacks; every process is ended by pid.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, results, fn, args), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    errors: dict[int | str, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) + len(errors) < world_size:
            try:
                rank, ok, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [p.pid for p in procs if p.exitcode not in (None, 0)]
                if dead and results.empty():
                    errors["dead"] = f"rank processes {dead} died without a result"
                    break
                if time.monotonic() > deadline:
                    if not errors:
                        errors["timeout"] = (
                            f"timed out after {timeout:.0f}s; results from ranks {sorted(got)}"
                        )
                    break
                continue
            if ok:
                got[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
                # The other ranks usually fail next (a peer hung up); give them a moment so
                # the root cause and its consequences are reported together.
                deadline = min(deadline, time.monotonic() + 5)
    finally:
        for p in procs:
            p.join(timeout=1 if errors else 10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    if errors:
        report = "\n".join(
            f"rank {k}:\n{v}" if isinstance(k, int) else v for k, v in errors.items()
        )
        raise RuntimeError(f"distributed test failed:\n{report}")
    return [got[r] for r in range(world_size)]


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_train(
    nproc: int, args: list[str], env: dict | None = None, stdout: Any = subprocess.PIPE
) -> subprocess.Popen:
    """Start `train.py args` under torchrun with `nproc` processes (or plainly if 0), in a
    session of its own, output (stdout and stderr) to `stdout`; do not wait."""
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc_per_node={nproc}", "train.py", *args]
    else:
        cmd = [sys.executable, "train.py", *args]
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def launch(nproc: int, args: list[str], timeout: float = 240.0, env: dict | None = None) -> Any:
    """Run `train.py args` as `start_train` does and wait for it.

    Returns the CompletedProcess; the whole process group is killed on timeout.
    """
    proc = start_train(nproc, args, env)
    cmd = proc.args
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise RuntimeError(f"{cmd} timed out after {timeout}s:\n{out[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send `sig` (SIGKILL) to `pid` and every process descended from it (torchrun's workers
    included)."""
    children: dict[int, list[int]] = {}
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                with open(f"/proc/{stat}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(stat))
    todo, tree = [pid], []
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    for p in reversed(tree):  # workers first, so none outlives its launcher
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
