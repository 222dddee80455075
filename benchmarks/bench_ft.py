"""Fault tolerance: per-step overhead of the FT container, and recovery times after a kill.

    .venv/bin/python benchmarks/bench_ft.py [--steps 150]

All in one run, on loopback, with train.py processes (one per replica group) and a real
torchft lighthouse: the median step time of the default container (no torchft), of the FT
container with 1 replica group and with 2; then, with 2 groups, the time from a SIGKILL of one
group to the survivor's next commit, and from restarting it to its first healed commit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table
from tests.harness.dist import launch
from tests.harness.ftjob import FTJob, read_metrics


def step_ms(metrics: dict[int, dict], first: int = 11, last: int | None = None) -> list[float]:
    """The step times (ms) of steps `first`..`last` (the first ones warm up)."""
    return [
        1e3 * m["step_time_s"]
        for s, m in metrics.items()
        if s >= first and (last is None or s <= last)
    ]


def median_iqr(times: list[float]) -> tuple[float, str]:
    q1, median, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return median, f"{median:.1f} ms (IQR {q1:.1f}-{q3:.1f})"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "base").mkdir()
        base = FTJob(root / "base", args.steps, flavor="debug")  # only its arguments: no torchft
        base.close()
        launch(0, base.train_args)
        default_ms, default_text = median_iqr(step_ms(read_metrics(root / "base")))

        (root / "one").mkdir()
        one = FTJob(root / "one", args.steps, ["--fault_tolerance.group_size", "1"], flavor="debug")
        try:
            one.start_replica(0)
            one.wait_exit("replica_0", 300)
        finally:
            one.close()
        one_ms, one_text = median_iqr(step_ms(one.metrics(0)))

        (root / "two").mkdir()
        two = FTJob(root / "two", 10 * args.steps, flavor="debug")
        try:
            two.start_replica(0)
            two.start_replica(1)
            two.wait_for(
                "40 steps", lambda: min(max(two.metrics(r), default=0) for r in (0, 1)) >= 40
            )
            two_ms, two_text = median_iqr(step_ms(two.metrics(0), last=40))
            two.kill("replica_1")
            at_kill = max(two.metrics(0))
            kill_to_commit = two.wait_for(
                "a survivor commit", lambda: max(two.metrics(0)) > at_kill, 60
            )
            before = max(two.metrics(1))
            start = time.monotonic()
            two.start_replica(1)
            two.wait_for(
                "a healed commit",
                lambda: any(s > before + 1 for s in two.metrics(1)),
                120,
            )
            restart_to_commit = time.monotonic() - start
        finally:
            two.close()
    print(f"debug model, seq 64 x 4, {args.steps} steps, CPU gloo, one process per replica group")
    rows = [
        ("step, default container (no torchft)", default_text, "", ""),
        (
            "step, FT container, 1 replica group",
            one_text,
            f"{one_ms - default_ms:+.1f} ms",
            "<= +3 ms",
        ),
        (
            "step, FT container, 2 replica groups",
            two_text,
            f"{two_ms - default_ms:+.1f} ms",
            "",
        ),
        ("SIGKILL of a group -> survivor's next commit", f"{kill_to_commit:.2f} s", "", ""),
        ("restart -> healed group's first commit", f"{restart_to_commit:.2f} s", "", "<= 5 s"),
    ]
    print(markdown_table(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
