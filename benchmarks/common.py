"""Shared by the benchmarks: the result table, and runs in fresh subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

HEADER = ("measure", "value", "ratio", "goal")


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    """A markdown table of (measure, value, ratio, goal) rows, sized to its contents."""
    widths = [max(len(r[i]) for r in (HEADER, *rows)) for i in range(len(HEADER))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(HEADER), rule, *(line(r) for r in rows)])


def run_fresh(script: str, argv: list[str]) -> dict[str, Any]:
    """Run `script argv` in a fresh Python process; return the JSON its last line prints.

    Large blocks go to mmap so freed memory leaves the resident set at once, which keeps
    peak-resident-memory figures honest.
    """
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(
        [sys.executable, script, *argv], env=env, check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])
