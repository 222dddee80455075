"""Shared by the benchmarks: the result table, and runs in fresh subprocesses."""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

HEADER = ("measure", "value", "ratio", "goal")


def markdown_table(rows: Sequence[Sequence[str]], header: Sequence[str] = HEADER) -> str:
    """A markdown table of rows under `header` (default: measure, value, ratio, goal), sized
    to its contents."""
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def rss() -> int:
    """This process's resident set in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> int:
    """Reset the peak resident set to the current one (Linux); return the current one."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss()


def peak_rss() -> int:
    """This process's peak resident set in bytes since the last `reset_peak_rss`."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def run_fresh(script: str, argv: list[str], for_memory: bool = True) -> dict[str, Any]:
    """Run `script argv` in a fresh Python process; return the JSON its last line prints.

    `for_memory`: large blocks go to mmap so freed memory leaves the resident set at once,
    which keeps peak-resident-memory figures honest (but makes every free of a large block a
    system call, which a timing should not pay: glibc's default reuses them).
    """
    env = {**os.environ, **({"MALLOC_MMAP_THRESHOLD_": "65536"} if for_memory else {})}
    out = subprocess.run(
        [sys.executable, script, *argv], env=env, check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def train_peak(model: nn.Module, optimizers: Any, x: torch.Tensor, steps: int) -> dict[str, float]:
    """Train `model` on `x` for `steps` steps through `optimizers` (a container); return the
    process's peak resident memory, the median step time (first step left out) and the bytes
    of the parameters (= of their gradients)."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizers.zero_grad()
        optimizers.backward(model(x).float().square().mean())
        optimizers.step()
        times.append(time.perf_counter() - start)
    return {
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_s": statistics.median(times[1:]),
        "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }
