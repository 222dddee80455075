"""Plot the loss curves of one or more runs into `loss.png` in the first run's dump folder.

    python -m scripts.plot DUMP_FOLDER [DUMP_FOLDER ...] [--key loss] [--out PATH]

Each folder's `metrics.jsonl` (what train.py writes there; a resumed run appends, and the
last row of a step wins) is one curve, all on the same axes so runs compare at a glance (e.g.
the mixed-precision quality runs beside an fp32 one), labelled by the config keys whose values
differ between the runs (from each run's `config.toml`), or by its folder. A folder of a
torchft job (its groups write `replica_<id>/metrics.jsonl`) gives one curve per group.
Steps whose value was not finite (null in the file) are left out. matplotlib, no display.

A last line cut short (a run killed while writing it) is skipped with a note. A line before
the last that is not a row is an error naming it (exit 2): train.py never writes one there
(a resumed run drops a cut line before it appends), so the file was damaged or edited, and a
curve drawn around the gap would pass for the run's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

__all__ = ["BadLine", "labels", "main", "plot", "read_metrics"]

Rows = dict[int, dict]
_HEAD = '{"step": '  # how every row train.py writes begins


class BadLine(ValueError):
    """A line of `metrics.jsonl` that is not a row and not a cut-short last line."""


def _row(line: str) -> dict | None:
    """`line` as a row (a JSON object with an integer step); None if it is not one."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def read_metrics(path: Path) -> tuple[Rows, int | None]:
    """`metrics.jsonl` as step -> row (a resumed run appends; the last row of a step wins),
    and the number of its last line if that was cut short (skipped), else None.

    Raises:
        BadLine: a line is not a row and not a cut-short last line.
        OSError: `path` cannot be read.
    """
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    rows: Rows = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        row = _row(line)
        if row is not None:
            rows[row["step"]] = row
        elif number == len(lines) and (line.startswith(_HEAD) or _HEAD.startswith(line)):
            return rows, number  # the start of a row: what a kill while writing it leaves
        else:
            raise BadLine(
                f"{path}:{number}: not a metrics row (a JSON object with an integer step); "
                "train.py writes none, so the file was damaged or edited: fix or delete that line"
            )
    return rows, None


def _curves(folder: Path) -> list[Path]:
    """The metrics file of each run in `folder`: its own, or its replica groups'."""
    own = folder / "metrics.jsonl"
    return [own] if own.is_file() else sorted(folder.glob("replica_*/metrics.jsonl"))


_SAME_RUN = {"job.dump_folder", "job.config_file"}  # where a run is, not what it trains


def _settings(folder: Path) -> dict[str, Any]:
    """The run's `config.toml` (as train.py saved it) as {"section.key": value}; {} if none."""
    try:
        config = tomllib.loads((folder / "config.toml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return {}
    return {
        f"{section}.{key}": value
        for section, table in config.items()
        if isinstance(table, dict)
        for key, value in table.items()
        if f"{section}.{key}" not in _SAME_RUN
    }


def labels(folders: list[Path]) -> list[str]:
    """A legend label per run folder: the config keys whose values differ between the runs
    (`section.key=value`), else the folder; the folder too where two labels would be equal."""
    settings = [_settings(f) for f in folders]
    known = [s for s in settings if s]  # (a run without its config.toml is named by folder)
    keys = sorted({k for s in known for k in s})
    differ = [k for k in keys if len({json.dumps(s.get(k), default=str) for s in known}) > 1]
    named = [", ".join(f"{k}={s[k]}" for k in differ if k in s) for s in settings]
    return [
        str(folder) if not name else f"{name} ({folder})" if named.count(name) > 1 else name
        for name, folder in zip(named, folders)
    ]


def plot(runs: list[tuple[str, Rows]], out: Path, key: str = "loss") -> int:
    """Draw `key` over the steps of each (label, rows) run into `out`; returns the curves."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5), dpi=100)
    curves = 0
    for label, rows in runs:
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
    try:
        fig.savefig(out)
    finally:
        plt.close(fig)
    return curves


def _read_runs(folders: list[Path]) -> list[tuple[str, Rows]]:
    """(label, rows) of every run in `folders`; a note on stderr for each cut-short last line.

    Raises:
        BadLine, OSError: as `read_metrics`.
    """
    curves = [path for folder in folders for path in _curves(folder)]
    runs = []
    for label, path in zip(labels([path.parent for path in curves]), curves):
        rows, cut = read_metrics(path)
        if cut is not None:
            print(
                f"note: skipped {path}:{cut}, the last line: a row cut short (as a kill "
                "while writing it leaves)",
                file=sys.stderr,
            )
        runs.append((label, rows))
    return runs


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
    try:
        curves = plot(_read_runs(args.folders), out, args.key)
    except (ValueError, OSError) as e:  # BadLine; --out unwritable or of no image format
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not curves:
        print(f"error: no finite {args.key!r} values in those runs", file=sys.stderr)
        return 2
    print(f"wrote {out}: {args.key} of {curves} run{'s' if curves > 1 else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
