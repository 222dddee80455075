"""A markdown table of (measure, value, ratio, goal) rows, sized to its contents."""

from __future__ import annotations

from collections.abc import Sequence

HEADER = ("measure", "value", "ratio", "goal")


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in (HEADER, *rows)) for i in range(len(HEADER))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join(
        [line(HEADER), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        + [line(r) for r in rows]
    )
