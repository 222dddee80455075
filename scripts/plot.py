"""Plot the loss curves of one or more runs into `loss.png` in the first run's dump folder.

    python -m scripts.plot DUMP_FOLDER [DUMP_FOLDER ...] [--key loss] [--out PATH]

Each folder's `metrics.jsonl` (what train.py writes there; a resumed run appends, and the
last row of a step wins) is one curve, labelled by its folder, all on the same axes so runs
compare at a glance (e.g. the mixed-precision quality runs beside an fp32 one). A folder of a
torchft job (its groups write `replica_<id>/metrics.jsonl`) gives one curve per group.
Steps whose value was not finite (null in the file) are left out. matplotlib, no display.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["main", "plot", "read_metrics"]


def read_metrics(path: Path) -> dict[int, dict]:
    """`metrics.jsonl` as step -> row (a resumed run appends; the last row of a step wins)."""
    rows = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line)
    return {row["step"]: row for row in rows}


def _curves(folder: Path) -> list[tuple[str, Path]]:
    """(label, metrics file) of each run in `folder`: its own, or its replica groups'."""
    own = folder / "metrics.jsonl"
    if own.is_file():
        return [(str(folder), own)]
    groups = sorted(folder.glob("replica_*/metrics.jsonl"))
    return [(str(path.parent), path) for path in groups]


def plot(folders: list[Path], out: Path, key: str = "loss") -> int:
    """Draw `key` over the steps of every run in `folders` into `out`; returns the curves."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5), dpi=100)
    curves = 0
    for folder in folders:
        for label, path in _curves(folder):
            rows = read_metrics(path)
            points = [(s, r[key]) for s, r in sorted(rows.items()) if r.get(key) is not None]
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, label=label, marker="." if len(points) < 50 else None)
                curves += 1
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(f"{key} over steps")
    ax.grid(True, alpha=0.3)
    if curves:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return curves


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.plot", description=__doc__)
    parser.add_argument("folders", nargs="+", type=Path, help="dump folders of train.py runs")
    parser.add_argument("--key", default="loss", help="metrics.jsonl column to plot")
    parser.add_argument("--out", type=Path, help="image to write (default: FIRST/<key>.png)")
    args = parser.parse_args(argv)
    missing = [str(f) for f in args.folders if not _curves(f)]
    if missing:
        print(
            f"error: no metrics.jsonl in {', '.join(missing)}; pass the --job.dump_folder of "
            "a train.py run",
            file=sys.stderr,
        )
        return 2
    out = args.out or args.folders[0] / f"{args.key}.png"
    curves = plot(args.folders, out, args.key)
    if not curves:
        print(f"error: no finite {args.key!r} values in those runs", file=sys.stderr)
        return 2
    print(f"wrote {out}: {args.key} of {curves} run{'s' if curves > 1 else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
