"""Run a test body on N real gloo ranks, each in its own process, with bounded waits."""

from __future__ import annotations

import io
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    rank: int, world_size: int, port: int, results: Any, fn: Callable, args: tuple, env: dict
) -> None:
    """Rank `rank` of `world_size` (0: a plain process, no process group) runs `fn(*args)`."""
    os.environ.clear()  # the caller's, also in a rank forked from a server started earlier
    os.environ.update(env)
    if world_size:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
        )
    torch.set_num_threads(1)
    try:
        if world_size:
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
            if dist.is_initialized():  # `fn` may have ended it (train.main does)
                dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


# Ranks fork from one server process that imported these once: starting N ranks costs
# milliseconds instead of N fresh imports of torch (seconds each on 2 cores). The server
# itself is a fresh interpreter, so the ranks inherit no threads or process-group state.
_PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",
    "containers",
    "components.job",
    "tests.harness.helpers",
    "train",
]


def _forkserver() -> Any:
    """The multiprocessing context whose ranks fork from one server that imported `_PRELOAD`."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs
    # The server imports from its own sys.path (Python 3.11 ignores the caller's): start it
    # with this repository on PYTHONPATH, wherever pytest was started from.
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, before) if p)
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return ctx


def run_ranks(
    world_size: int,
    fn: Callable,
    *args: Any,
    timeout: float = 180.0,
    ends_all: Callable[[Any], bool] | None = None,
) -> list[Any]:
    """Run `fn(*args)` on `world_size` gloo ranks and return each rank's result, by rank.

    `fn` must be importable (module level). Any rank's exception, a rank that dies, or the
    timeout fails the call with the ranks' tracebacks; every process is ended by pid. A
    result for which `ends_all` is true ends the other ranks at once (as a launcher ends a
    job when one rank fails); theirs are then None. `world_size` 0: one plain process, in no
    process group.
    """
    nproc = max(world_size, 1)
    ctx = _forkserver()
    results = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, results, fn, args, env), daemon=True)
        for r in range(nproc)
    ]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    errors: dict[int | str, str] = {}
    ended = False
    deadline = time.monotonic() + timeout
    try:
        while len(got) + len(errors) < nproc and not ended:
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
                ended = ends_all is not None and ends_all(got[rank])
            else:
                errors[rank] = payload
                # The other ranks usually fail next (a peer hung up); give them a moment so
                # the root cause and its consequences are reported together.
                deadline = min(deadline, time.monotonic() + 5)
    finally:
        for r, p in enumerate(procs):
            # A rank that gave its result is exiting (its atexit work included): let it.
            p.join(timeout=0 if ended and r not in got else 1 if errors else 10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    if errors:
        report = "\n".join(
            f"rank {k}:\n{v}" if isinstance(k, int) else v for k, v in errors.items()
        )
        raise RuntimeError(f"distributed test failed:\n{report}")
    return [got.get(r) for r in range(nproc)]


def _train_run(argv: list[str], faults: list[str]) -> int:
    """`train.run` as `python train.py argv` calls it, or with `faults` as
    `python -m tests.harness.faults faults... argv` does: the exit code."""
    import train

    if not faults:
        return train.run(argv)
    from tests.harness import faults as harness

    args = lambda a: harness.parse(a)[2]  # noqa: E731
    return train.run([*faults, *argv], harness.__file__, harness.main, train_args=args)


def _train_rank(argv: list[str], out_dir: str, faults: list[str]) -> int:
    """`python train.py argv` as one of its ranks runs it (`train.run`, no launcher), in this
    process, its output (console log lines, stdout and stderr) to `out_dir/<rank>`: the exit
    code. `faults`: those of `python -m tests.harness.faults` to inject."""
    import contextlib
    import logging

    from components.logs import FORMAT
    from components.run_lock import release_held

    path = os.path.join(out_dir, os.environ["RANK"])
    # By line: a rank that another's failure ended keeps what it said.
    with (
        open(path, "w", buffering=1) as out,
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(out),
    ):
        logging.basicConfig(level=logging.INFO, format=FORMAT, stream=out, force=True)
        code = _train_run(argv, faults)
        release_held()  # what `train.exit_now` does before the process exits
        logging.shutdown()
    return code


def train_ranks(
    nproc: int, argv: list[str], timeout: float = 240.0, faults: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """Run train.py's ranks on `nproc` (1 for a plain `python train.py`) forked gloo ranks, as
    `launch` runs them, without a fresh interpreter per rank: the CompletedProcess a launch by
    train.py's launcher gives (a rank that fails ends the others; the first failed rank's exit
    code; the ranks' output, rank 0's first).

    For every test whose subject is the run, not the process (signals, launchers, locks
    between processes and exits of a dead parent keep `launch`). `faults`: as
    `python -m tests.harness.faults FAULT... argv` runs.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        args = (argv, out_dir, list(faults))
        codes = run_ranks(max(nproc, 1), _train_rank, *args, timeout=timeout, ends_all=bool)
        out = "".join(Path(out_dir, str(r)).read_text() for r in range(max(nproc, 1)))
    failed = [code for code in codes if code]
    return subprocess.CompletedProcess(["train.py", *argv], failed[0] if failed else 0, out)


def run_here(argv: list[str]) -> subprocess.CompletedProcess:
    """`python train.py argv` in this process where it ends before any rank starts (the
    launcher's config check, `--help`): exit code, stdout and stderr (its log lines)."""
    import contextlib
    import logging

    import train
    from components.logs import FORMAT

    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = train.run(argv)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    return subprocess.CompletedProcess(["train.py", *argv], code, out.getvalue(), err.getvalue())


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start(
    nproc: int,
    args: list[str],
    env: dict | None = None,
    torchrun: bool = True,
    stdout: Any = subprocess.PIPE,
) -> subprocess.Popen:
    """Start `train.py args` with `nproc` ranks under torchrun (or train.py's own launcher),
    or plainly if 0, in a session of its own, output (stdout and stderr) to `stdout`; do not
    wait."""
    if nproc and torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc_per_node={nproc}", "train.py", *args]
    elif nproc:
        cmd = [sys.executable, "train.py", f"--nproc_per_node={nproc}", *args]
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


def _output_to(log: str, env: dict) -> None:
    """This (forked) process as one started from the checkout with `env`, its file
    descriptors 1 and 2 appended to `log`."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _replica(argv: list[str], faults: list[str], log: str, env: dict) -> None:
    """`python train.py argv` (or `python -m tests.harness.faults faults... argv`) as its
    process runs it, output to `log`, exit code as the process's (`train.exit_now`)."""
    import logging

    import train
    from components.logs import FORMAT

    _output_to(log, env)
    logging.basicConfig(level=logging.INFO, format=FORMAT, force=True)
    train.exit_now(_train_run(argv, faults))


def _main_of(args: list[str]) -> int:
    """`python -m args...` as its `__main__` runs, in this process: the exit code."""
    import runpy

    sys.argv = list(args)
    try:
        runpy.run_module(args[0], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    return 0


def _module(args: list[str], log: str, env: dict) -> None:
    """`python -m args...` as its process runs it, output to `log`."""
    _output_to(log, env)
    code = _main_of(args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _lighthouse(settings: dict, log: str, env: dict) -> None:
    """torchft's lighthouse server (what `torchft_lighthouse` runs) until killed."""
    from torchft._torchft import LighthouseServer

    _output_to(log, env)
    server = LighthouseServer(**settings)  # noqa: F841  (serves while referenced)
    while True:
        time.sleep(3600)


class Forked:
    """A process forked from the test server (`forked`), waited for as a Popen is."""

    def __init__(self, process: Any) -> None:
        self.process = process
        self.pid = process.pid

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        return self.process.exitcode


def forked(
    argv: list[str],
    log: Any,
    faults: tuple[str, ...] = (),
    lighthouse: dict | None = None,
    module: str = "",
) -> Forked:
    """Start `python train.py argv` (`faults`: `python -m tests.harness.faults faults...
    argv`; `module`: `python -m module argv`; `lighthouse`: torchft's lighthouse with these
    settings) from the checkout, forked from the test server instead of a fresh interpreter,
    output appended to the file `log`; do not wait. Its ranks, where `--nproc_per_node` asks
    for several, are train.py's launcher's own processes."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    Path(log).touch()  # there to read from the start
    if lighthouse is not None:
        target, args = _lighthouse, (lighthouse, str(log), env)
    elif module:
        target, args = _module, ([module, *argv], str(log), env)
    else:
        target, args = _replica, (argv, list(faults), str(log), env)
    process = _forkserver().Process(target=target, args=args, daemon=True)
    process.start()
    return Forked(process)


def _script(name: str, args: tuple[str, ...], cwd: str) -> tuple[int, str, str]:
    """`python -m scripts.<name> args` in this (forked) process, from `cwd`: exit code,
    stdout, stderr."""
    import contextlib

    os.chdir(cwd)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = _main_of([f"scripts.{name}", *args])
    return code, out.getvalue(), err.getvalue()


def run_script(
    name: str, *args: str, cwd: Any, process: bool = False
) -> subprocess.CompletedProcess:
    """`python -m scripts.<name> args` from another directory `cwd`, output captured: in a
    process forked from the test server (its `__main__` as written), or a `process` of its
    own with the checkout on PYTHONPATH (the installed distribution holds the library only)."""
    if not process:
        ((code, out, err),) = run_ranks(0, _script, name, args, str(cwd), timeout=120)
        return subprocess.CompletedProcess([name, *args], code, out, err)
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", f"scripts.{name}", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
    )


def finish(proc: subprocess.Popen, timeout: float = 240.0) -> subprocess.CompletedProcess:
    """Wait for `proc` (from `start`); on timeout kill its process tree and raise."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        raise RuntimeError(f"{proc.args} timed out after {timeout}s:\n{out[-4000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def launch(
    nproc: int,
    args: list[str],
    timeout: float = 240.0,
    env: dict | None = None,
    torchrun: bool = True,
) -> Any:
    """Run `train.py args` as `start` does and wait for it: the CompletedProcess.

    The whole process tree is killed on timeout.
    """
    return finish(start(nproc, args, env, torchrun), timeout)


def worker_pids(launcher: int) -> dict[int, int]:
    """The processes below `launcher` that run train.py as a rank: rank -> pid."""
    found = {}
    for pid in _descendants(launcher):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env and pid != launcher:
            found[int(env[b"RANK"])] = pid
    return found


def _descendants(pid: int) -> list[int]:
    """`pid` and every process descended from it, parents first."""
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
    return tree


def _alive(pid: int) -> bool:
    """Whether `pid` still runs: a zombie has closed its files (and released its locks)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_tree(pid: int, sig: int = signal.SIGKILL, wait_s: float = 120.0) -> None:
    """Send `sig` (SIGKILL) to `pid` and every process descended from it (torchrun's workers
    included), workers first, so none outlives its launcher.

    With SIGKILL, returns once every one of them has exited (bounded by `wait_s`): a rank
    killed in the middle of a disk write exits only when the write ends, and holds its files
    and its run lock until then."""
    tree = _descendants(pid)
    for p in reversed(tree):
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while sig == signal.SIGKILL and any(_alive(p) for p in tree):
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {[p for p in tree if _alive(p)]} outlived SIGKILL")
        time.sleep(0.01)
