"""Routed experts as grouped 3-D tensors: the container's optimizer step against the same
parameters held as dense 2-D matrices and as E separate 2-D matrices.

    .venv/bin/python benchmarks/bench_experts.py             # 16 experts x [256, 128] x 3, ~30 s
    .venv/bin/python benchmarks/bench_experts.py --quick     # smoke run

One MoE layer's routed experts (torchtitan's GroupedExperts: w1, w3 `[E, dim, hidden]`, w2
`[E, hidden, dim]`) in three layouts of the same parameter count:
- dense: three Linear weights `[E*hidden, dim]`, `[E*hidden, dim]`, `[dim, E*hidden]`;
- separate: E matrices each (`[dim, hidden]` x 2, `[hidden, dim]`), 3E tensors;
- 3-D: the three grouped tensors.
Each optimizer steps its own copy of each layout on fixed gradients (fresh each step, as
backward gives), timed interleaved (order reversed on odd repeats) at 1 thread, medians of
`--repeats` repeats of `--steps` steps. Elementwise optimizers do the same work in every
layout. Muon does not: it orthogonalizes each expert's matrix on its own (as torchtitan), so
the dense layout is other math (one Newton-Schulz over `[dim, E*hidden]`); its like for like
is the separate layout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table
from containers import (
    LeanAdamW,
    MixedPrecisionOptimizersContainer,
    OptimizersContainer,
    ShardedMuon,
)

ADAMW = {"lr": 1e-3, "weight_decay": 0.1, "fused": True}
MUON = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw", "ns_dtype": "float32"}
Build = Callable[[nn.Module], OptimizersContainer]

# name -> (parameter dtype, container, the layout 3-D is held to 1.05x of)
OPTIMIZERS: dict[str, tuple[torch.dtype, Build, str]] = {
    "fused AdamW, fp32": (
        torch.float32, lambda m: OptimizersContainer([m], torch.optim.AdamW, ADAMW), "dense"
    ),
    "mixed precision (masters flat)": (
        torch.bfloat16,
        lambda m: MixedPrecisionOptimizersContainer([m], torch.optim.AdamW, ADAMW),
        "dense",
    ),
    "AdamW, 8-bit moments": (
        torch.float32,
        lambda m: OptimizersContainer([m], LeanAdamW, {**ADAMW, "moment_dtype": "8bit"}),
        "dense",
    ),
    "Muon, fp32 Newton-Schulz": (
        torch.float32, lambda m: OptimizersContainer([m], ShardedMuon, MUON), "separate"
    ),
}  # fmt: skip


def layouts(experts: int, dim: int, hidden: int) -> dict[str, dict[str, tuple[int, ...]]]:
    """Parameter shapes by name, by layout."""
    wide = experts * hidden
    separate = {}
    for e in range(experts):
        separate |= {f"w1_{e}": (dim, hidden), f"w3_{e}": (dim, hidden), f"w2_{e}": (hidden, dim)}
    return {
        "dense": {"w1": (wide, dim), "w3": (wide, dim), "w2": (dim, wide)},
        "separate": separate,
        "3-D": {
            "w1": (experts, dim, hidden),
            "w3": (experts, dim, hidden),
            "w2": (experts, hidden, dim),
        },
    }


def _module(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    module = nn.Module()
    for name, shape in shapes.items():
        value = torch.randn(shape, generator=g) * 0.02
        module.register_parameter(name, nn.Parameter(value.to(dtype)))
    return module


def time_steps(
    build: Build, dtype: torch.dtype, shapes: dict[str, dict[str, tuple[int, ...]]],
    repeats: int, steps: int,
) -> dict[str, float]:  # fmt: skip
    """Median seconds of one step, by layout (each its own copy, interleaved)."""
    runs = {}
    for layout, by_name in shapes.items():
        module = _module(by_name, dtype)
        g = torch.Generator().manual_seed(1)
        grads = [torch.randn(p.shape, generator=g).to(dtype) for p in module.parameters()]
        runs[layout] = (module, build(module), grads)
    times: dict[str, list[float]] = {layout: [] for layout in runs}
    for r in range(repeats):
        for layout in list(runs) if r % 2 == 0 else list(reversed(runs)):
            module, opt, grads = runs[layout]
            elapsed = 0.0
            for k in range(steps + 1):  # the first makes the state
                for p, grad in zip(module.parameters(), grads):
                    p.grad = grad.clone()
                start = time.perf_counter()
                opt.step()
                elapsed += (time.perf_counter() - start) if k else 0.0
            times[layout].append(elapsed / steps)
    return {layout: statistics.median(t) for layout, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks it runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.experts, args.dim, args.hidden, args.repeats, args.steps = 4, 32, 16, 1, 1
    torch.set_num_threads(1)
    shapes = layouts(args.experts, args.dim, args.hidden)
    numel = sum(torch.Size(s).numel() for s in shapes["3-D"].values())
    print(
        f"torch {torch.__version__}, {args.experts} experts x [{args.dim}, {args.hidden}] x 3 "
        f"({numel / 1e6:.2f}M params), 1 thread, medians of {args.repeats} interleaved repeats "
        f"of {args.steps} steps"
    )
    rows = []
    for name, (dtype, build, against) in OPTIMIZERS.items():
        t = time_steps(build, dtype, shapes, args.repeats, args.steps)
        ratio = t["3-D"] / t[against]
        rows.append(
            (
                name,
                *(f"{t[layout] * 1e3:.2f}" for layout in ("dense", "separate", "3-D")),
                f"{t['3-D'] / t['dense']:.2f}",
                f"{t['3-D'] / t['separate']:.2f}",
                f"3-D / {against} <= 1.05 {'PASS' if ratio <= 1.05 else 'MISS'}",
            )
        )
    header = (
        "optimizer step",
        "dense ms",
        "separate ms",
        "3-D ms",
        "3-D / dense",
        "3-D / separate",
        "goal",
    )
    print(markdown_table(rows, header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
