"""train.py with one torchft failure injected: `python -m tests.harness.noncommit N args...`.

The first attempt of step N reports an error to the real torchft manager (what a failed
collective does), so torchft does not commit that attempt and the trainer runs it again.
"""

from __future__ import annotations

import sys

import train
from components.job import Job, build_job
from config import JobConfig


def main(fail_step: int, argv: list[str]) -> int:
    def build_failing_job(cfg: JobConfig) -> Job:
        job = build_job(cfg)
        forward_backward, failed = job.forward_backward, []

        def failing(*args):
            if job.train_state.step + 1 == fail_step and not failed:
                failed.append(fail_step)
                job.ft_manager.report_error(RuntimeError(f"injected failure at step {fail_step}"))
            return forward_backward(*args)

        job.forward_backward = failing
        return job

    train.build_job = build_failing_job
    return train.main(argv)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2:]))
