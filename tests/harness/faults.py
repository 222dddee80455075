"""train.py with torchft faults or pauses injected at given steps.

    python -m tests.harness.faults FAULT... train-args...    # also with --nproc_per_node N

Each FAULT is one of:
- `fail STEP`: the first attempt of step STEP reports an error to the real torchft manager
  (what a failed collective does), so torchft does not commit that attempt and the trainer
  runs it again.
- `overflow STEP`: after the first attempt's backward of step STEP, this replica group's
  gradients hold inf (what an fp16 overflow leaves), before the average across groups.
- `lag STEP RANK SECONDS`: after the first attempt's backward of step STEP, rank RANK of the
  group sleeps SECONDS before `step()`: it reaches the commit late, as a rank still
  configuring the quorum's process group does.
- `signal STEP RANK`: after the first micro-batch's backward of step STEP, rank RANK sends
  itself SIGTERM (a preemption in the middle of a step's accumulation).
- `hold STEP FILE`: every rank waits at the start of step STEP (its quorum already asked for)
  while FILE exists: the replica group stays in the job, its manager heartbeating, and commits
  nothing more until the test removes FILE (at most 5 minutes).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

import train
from components.job import Job, build_job
from config import JobConfig

_HOLD_LIMIT_S = 300.0
Fault = Callable[[Job], None]


def _fail(step: int) -> Fault:
    failed: list[int] = []

    def fail(job: Job) -> None:
        if not failed:
            failed.append(step)
            job.ft_manager.report_error(RuntimeError(f"injected failure at step {step}"))

    return fail


def _overflow(step: int) -> Fault:
    done: list[int] = []

    def overflow(job: Job) -> None:
        if not done:
            done.append(step)
            for part in job.model_parts:
                for p in part.parameters():
                    if p.grad is not None:
                        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                        grad.fill_(math.inf)

    return overflow


def _lag(rank: int, seconds: float) -> Fault:
    done: list[bool] = []

    def lag(job: Job) -> None:
        if not done:
            done.append(True)
            if job.rank == rank:
                time.sleep(seconds)

    return lag


def _signal(rank: int) -> Fault:
    done: list[bool] = []

    def send(job: Job) -> None:
        if not done:
            done.append(True)
            if job.rank == rank:
                os.kill(os.getpid(), signal.SIGTERM)

    return send


def _hold(path: str) -> Fault:
    def hold(job: Job) -> None:
        deadline = time.monotonic() + _HOLD_LIMIT_S
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)

    return hold


Faults = dict[int, list[Fault]]


def parse(args: list[str]) -> tuple[Faults, Faults, list[str]]:
    """The faults by step (those before the step's forward, those after its backward), and
    the train.py arguments that follow them."""
    before: Faults = {}
    after: Faults = {}
    while args and not args[0].startswith("--"):
        kind, step = args[0], int(args[1])
        if kind == "fail":
            fault, args, when = _fail(step), args[2:], before
        elif kind == "overflow":
            fault, args, when = _overflow(step), args[2:], after
        elif kind == "lag":
            fault, args, when = _lag(int(args[2]), float(args[3])), args[4:], after
        elif kind == "signal":
            fault, args, when = _signal(int(args[2])), args[3:], after
        elif kind == "hold":
            fault, args, when = _hold(args[2]), args[3:], before
        else:
            raise SystemExit(
                f"unknown fault {kind!r}: expected 'fail', 'overflow', 'lag', 'signal' or 'hold'"
            )
        when.setdefault(step, []).append(fault)
    return before, after, args


def main(args: list[str]) -> int:
    before, after, argv = parse(args)

    def build_faulty_job(cfg: JobConfig) -> Job:
        job = build_job(cfg)
        forward_backward = job.forward_backward

        def faulty(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            step = job.train_state.step + 1
            for fault in before.get(step, ()):
                fault(job)
            loss = forward_backward(inputs, labels)
            for fault in after.get(step, ()):
                fault(job)
            return loss

        job.forward_backward = faulty
        return job

    train.build_job = build_faulty_job
    return train.main(argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    # The ranks run this file by its path: the repository must be on their import path.
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (repo, os.environ.get("PYTHONPATH"))))
    train.exit_now(train.run(sys.argv[1:], __file__, main, train_args=lambda a: parse(a)[2]))
