"""train.py with torchft faults or pauses injected at given steps.

    python -m tests.harness.faults FAULT... train-args...    # also with --nproc_per_node N

Each FAULT is one of:
- `fail STEP`: the first attempt of step STEP reports an error to the real torchft manager
  (what a failed collective does), so torchft does not commit that attempt and the trainer
  runs it again.
- `hold STEP FILE`: every rank waits at the start of step STEP (its quorum already asked for)
  while FILE exists: the replica group stays in the job, its manager heartbeating, and commits
  nothing more until the test removes FILE (at most 5 minutes).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable

import torch

import train
from components.job import Job, build_job
from components.launcher import launch, split_nproc
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


def _hold(path: str) -> Fault:
    def hold(job: Job) -> None:
        deadline = time.monotonic() + _HOLD_LIMIT_S
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)

    return hold


def parse(args: list[str]) -> tuple[dict[int, list[Fault]], list[str]]:
    """The faults by step, and the train.py arguments that follow them."""
    faults: dict[int, list[Fault]] = {}
    while args and not args[0].startswith("--"):
        kind, step = args[0], int(args[1])
        if kind == "fail":
            fault, args = _fail(step), args[2:]
        elif kind == "hold":
            fault, args = _hold(args[2]), args[3:]
        else:
            raise SystemExit(f"unknown fault {kind!r}: expected 'fail' or 'hold'")
        faults.setdefault(step, []).append(fault)
    return faults, args


def main(args: list[str]) -> int:
    faults, argv = parse(args)

    def build_faulty_job(cfg: JobConfig) -> Job:
        job = build_job(cfg)
        forward_backward = job.forward_backward

        def faulty(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            for fault in faults.get(job.train_state.step + 1, ()):
                fault(job)
            return forward_backward(inputs, labels)

        job.forward_backward = faulty
        return job

    train.build_job = build_faulty_job
    return train.main(argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    nproc, rest = split_nproc(sys.argv[1:])
    if nproc is None:
        sys.exit(main(rest))
    # The ranks run this file by its path: the repository must be on their import path.
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (repo, os.environ.get("PYTHONPATH"))))
    sys.exit(launch(__file__, nproc, rest))
