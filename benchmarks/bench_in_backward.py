"""Peak memory and step time of the in-backward container against the default container.

    .venv/bin/python benchmarks/bench_in_backward.py [--width 2048] [--layers 16] [--quick]

Each measurement runs in a fresh subprocess (peak resident memory is a per-process high-water
mark), alternating default / in-backward for two rounds. The model is a stack of square
Linear layers fed a small batch, so gradients are a large share of memory; AdamW (fused).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, run_fresh, train_peak
from containers import InBackward, OptimizersContainer, OptimizersInBackwardContainer


def child(container: str, width: int, layers: int, steps: int) -> dict[str, float]:
    """Train `steps` steps; return peak RSS and per-step times."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    kwargs = {"lr": 1e-4, "fused": True}
    if container == "in_backward_unchecked":  # no finite check per unit: what it costs
        optimizers = OptimizersContainer(
            [model], torch.optim.AdamW, kwargs, timing=InBackward(), skip_nonfinite=False
        )
    elif container == "in_backward":
        optimizers = OptimizersInBackwardContainer([model], torch.optim.AdamW, kwargs)
    else:
        optimizers = OptimizersContainer([model], torch.optim.AdamW, kwargs)
    return train_peak(model, optimizers, torch.randn(4, width), steps)


def run_child(container: str, args: argparse.Namespace) -> dict[str, float]:
    argv = ["--child", container, "--width", str(args.width), "--layers", str(args.layers)]
    return run_fresh(__file__, [*argv, "--steps", str(args.steps)])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    parser.add_argument(
        "--child",
        choices=["default", "in_backward", "in_backward_unchecked"],
        help=argparse.SUPPRESS,
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.layers, args.steps = 256, 4, 3
    if args.child:
        print(json.dumps(child(args.child, args.width, args.layers, args.steps)))
        return
    runs: dict[str, list[dict[str, float]]] = {
        "default": [],
        "in_backward": [],
        "in_backward_unchecked": [],
    }
    for _ in range(2):
        for name in runs:
            runs[name].append(run_child(name, args))
    peak = {k: min(r["peak_rss"] for r in v) for k, v in runs.items()}
    step = {k: statistics.median(r["step_s"] for r in v) for k, v in runs.items()}
    grad_bytes = runs["default"][0]["grad_bytes"]
    saved = (peak["default"] - peak["in_backward"]) / grad_bytes
    print(
        f"torch {torch.__version__}, {args.layers} x Linear({args.width}, {args.width}), "
        f"{grad_bytes / 4 / 1e6:.1f}M params, AdamW fused, gradients {grad_bytes / 2**20:.0f} MiB; "
        f"fresh subprocess per run, 2 rounds"
    )
    rows = [
        ("peak RSS, default container", f"{peak['default'] / 2**20:.0f} MiB", "", ""),
        ("peak RSS, in-backward container", f"{peak['in_backward'] / 2**20:.0f} MiB", "", ""),
        ("memory saved / total gradient bytes", "", f"{saved:.2f}", ">= 0.9"),
        (
            "step time, in-backward / default",
            f"{step['in_backward'] * 1e3:.1f} vs {step['default'] * 1e3:.1f} ms",
            f"{step['in_backward'] / step['default']:.2f}",
            "<= 1.10",
        ),
        (
            "step time, in-backward: finite check per unit / none",
            f"{step['in_backward'] * 1e3:.1f} vs {step['in_backward_unchecked'] * 1e3:.1f} ms",
            f"{step['in_backward'] / step['in_backward_unchecked']:.2f}",
            "<= 1.10",
        ),
    ]
    print(markdown_table(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
