"""A real torchft job on loopback: a lighthouse and replica groups running train.py, each a
process forked from the test server (`tests.harness.dist.forked`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.harness.dist import Forked, forked, free_port, kill_tree


def read_metrics(folder: Path) -> dict[int, dict]:
    """`folder/metrics.jsonl` as step -> metrics (a resumed run appends; the latest wins)."""
    path = folder / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return {row["step"]: row for row in rows}


MOE = {"config/debug.toml": "config/moe.toml"}
EP2 = ["--parallelism.expert_parallel_degree", "2", "--training.seq_len", "32"]


class FTJob:
    """Starts a lighthouse and replica groups (train.py with `nproc` ranks each, the llama
    `flavor`: tests train the tiny one, benchmarks the debug one); ends them all."""

    def __init__(
        self,
        folder: Path,
        steps: int,
        extra: list[str] = (),
        nproc: int = 1,
        min_replicas: int = 1,
        join_timeout_ms: int = 500,
        flavor: str = "tiny",
    ) -> None:
        self.folder, self.steps, self.nproc = folder, steps, nproc
        self.min_replicas, self.join_timeout_ms = min_replicas, join_timeout_ms
        self.procs: dict[str, Forked] = {}
        self.killed: set[str] = set()
        for _ in range(5):  # a port free a moment ago may be taken before the bind
            self.port = free_port()
            if self.start_lighthouse(required=False):
                break
        else:
            raise RuntimeError(f"no lighthouse could bind a port: {self.log('lighthouse')}")
        self.train_args = [
            "--job.config_file", "config/debug.toml",
            "--job.dump_folder", str(folder),
            "--model.flavor", flavor,
            "--training.seq_len", "64",
            "--training.local_batch_size", "4",
            "--training.steps", str(steps),
            "--lr_scheduler.warmup_steps", "2",
            "--metrics.log_freq", "1",
            "--metrics.log_param_checksum",
            "--checkpoint.interval", str(steps),
        ]  # fmt: skip
        self.args = [
            *self.train_args,
            "--fault_tolerance.enable",
            "--fault_tolerance.group_size", "2",
            "--fault_tolerance.lighthouse", f"http://127.0.0.1:{self.port}",
            "--fault_tolerance.process_group_timeout_ms", "5000",
            *extra,
        ]  # fmt: skip

    @classmethod
    def moe(cls, folder: Path, steps: int, extra: list[str], **kwargs) -> FTJob:
        """A job of the tiny mixture of experts at EP 2 in each replica group of 2 ranks."""
        job = cls(folder, steps, [*EP2, *extra], nproc=2, **kwargs)
        job.args = [MOE.get(a, a) for a in job.args]
        return job

    def start_lighthouse(self, required: bool = True) -> bool:
        """Start the lighthouse on the job's port (again, after `kill("lighthouse")`), needing
        `min_replicas` groups for a quorum; return once it listens (True), or False if it
        exited first (the port was taken), which raises where `required`.

        A restarted lighthouse knows no group until it hears from one: with `min_replicas`
        1 the first group to reach it forms a quorum alone and trains on while the other
        catches up (and heals); with the number of live groups, they rejoin together.
        """
        settings = {"bind": f"127.0.0.1:{self.port}", "min_replicas": self.min_replicas}
        settings |= {"join_timeout_ms": self.join_timeout_ms, "quorum_tick_ms": 50}
        settings |= {"heartbeat_timeout_ms": 1000}
        log, listening = self.folder / "lighthouse.log", "Lighthouse listening on"
        before = log.read_text().count(listening) if log.exists() else 0  # (appended)
        process = forked([], log, lighthouse=settings)
        self.procs["lighthouse"] = process
        self.killed.discard("lighthouse")
        deadline = time.monotonic() + 60
        while process.poll() is None:  # (its own line: another server may hold the port)
            if log.read_text().count(listening) > before:
                return True
            if time.monotonic() > deadline:
                raise TimeoutError(f"the lighthouse on port {self.port} never listened")
            time.sleep(0.05)
        if required:
            raise RuntimeError(f"the lighthouse exited: {self.log('lighthouse')}")
        return False

    def start_module(self, name: str, module: str, args: list[str]) -> None:
        """Start `python -m module args` as the process `name` (a user's own loop)."""
        self.procs[name] = forked(args, self.folder / f"{name}.log", module=module)
        self.killed.discard(name)

    def start_replica(self, replica: int, script: tuple[str, ...] = ("train.py",)) -> None:
        """Start replica group `replica` as `python *script args` (with `--nproc_per_node`
        when the groups have several ranks: train.py's launcher, or `tests.harness.faults`),
        forked from the test server (`tests.harness.dist.forked`)."""
        argv = list(self.args)
        if self.nproc > 1:
            argv += ["--nproc_per_node", str(self.nproc)]
        argv += ["--fault_tolerance.replica_id", str(replica)]
        # Any free port, bound at once (torchft finds a group by the address it reports); a
        # port chosen here and bound seconds later may be taken meanwhile.
        argv += ["--fault_tolerance.manager_port", "0"]
        if script == ("train.py",):
            faults: tuple[str, ...] = ()
        elif script[:2] == ("-m", "tests.harness.faults"):
            faults = script[2:]
        else:
            raise ValueError(f"a replica runs train.py or tests.harness.faults, not {script}")
        name = f"replica_{replica}"
        self.procs[name] = forked(argv, self.folder / f"{name}.log", faults)
        self.killed.discard(name)

    def kill(self, name: str) -> None:
        kill_tree(self.procs[name].pid)
        self.procs[name].wait(timeout=30)
        self.killed.add(name)

    def metrics(self, replica: int) -> dict[int, dict]:
        """Committed steps of a replica group: step -> its metrics (the latest line wins)."""
        return read_metrics(self.folder / f"replica_{replica}")

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text()

    def healed_row(self, restarted_at: int, survivor: dict, healed: dict) -> int:
        """The step the restarted group healed in: its row holds no loss (its forward ran on its
        weights from before the heal) and a note saying why, where it had its pre-heal loss under
        that step's number; every other row of the restarted run holds its own loss. Returns it."""
        after = self.log("replica_1")[restarted_at:]
        assert after.count("healed from a peer replica group\n") == 1, after
        rows = {s: row for s, row in healed.items() if f"step {s:5d}  " in after}
        [step] = [s for s, row in rows.items() if "note" in row]
        row, note = rows[step], "healed from a peer replica group in this step: no loss"
        assert row["loss"] is None and row["note"].startswith(note), row
        assert f"step {step:5d}  loss -  lr" in after and f"({note}" in after, after
        assert row["param_checksum"] == survivor[step]["param_checksum"]
        assert all(isinstance(rows[s]["loss"], float) for s in rows if s != step), rows
        return step

    def wait_for(self, what: str, condition, timeout: float = 120.0) -> float:
        """Poll `condition()` until true; return the seconds it took."""
        start = time.monotonic()
        while not condition():
            for name, proc in self.procs.items():
                if name not in self.killed and proc.poll() not in (None, 0):
                    raise RuntimeError(f"{name} died while waiting for {what}:{self.tails()}")
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"no {what} within {timeout}s:{self.tails()}")
            time.sleep(0.02)
        return time.monotonic() - start

    def tails(self, chars: int = 3000) -> str:
        """The end of every process's log (a stop is often explained by another's)."""
        return "".join(f"\n--- {name}:\n{self.log(name)[-chars:]}" for name in self.procs)

    def run_both(self, script: tuple[str, ...] = ("train.py",), timeout: float = 180.0) -> None:
        """Start replica groups 0 and 1 with `script`, wait for both to end, then close the
        job; raise with every log's tail unless both exited 0."""
        try:
            for r in (0, 1):
                self.start_replica(r, script)
            codes = [self.wait_exit(f"replica_{r}", timeout) for r in (0, 1)]
        finally:
            self.close()
        if codes != [0, 0]:
            raise RuntimeError(f"replica groups exited {codes}:{self.tails()}")

    def join_late(self, at: int, extra: list[str], released_at: int = 0) -> tuple[int, int]:
        """Group 0 runs and is held at step `at` (once it committed step `at` - 1) until group
        1, started with `extra` arguments, has begun training (logged step `released_at`, if
        above 0: under DiLoCo, the step before its first sync, and asked the lighthouse for
        that sync's quorum, so group 0's next quorum cannot be a fast one of group 0 alone:
        both meet there); then both run to the end.
        Returns their exit codes (the job closed)."""
        hold = self.folder / "hold"
        hold.touch()
        try:
            self.start_replica(0, ("-m", "tests.harness.faults", "hold", str(at), str(hold)))
            self.wait_for(
                f"group 0 at step {at - 1}", lambda: max(self.metrics(0), default=0) == at - 1
            )
            self.args += extra
            self.start_replica(1)
            self.wait_for(
                "group 1",
                lambda: (
                    "micro-batches/step, from step 0" in self.log("replica_1")
                    and max(self.metrics(1), default=0) >= released_at
                    and (
                        not released_at
                        or "Received quorum request for replica replica_1" in self.log("lighthouse")
                    )
                ),
            )
            hold.unlink()
            return self.wait_exit("replica_0"), self.wait_exit("replica_1")
        finally:
            self.close()

    def wait_exit(self, name: str, timeout: float = 180.0) -> int:
        return self.procs[name].wait(timeout=timeout)

    def close(self) -> None:
        for proc in self.procs.values():
            kill_tree(proc.pid)
            proc.wait(timeout=30)
