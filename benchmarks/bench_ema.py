"""Step time with an EMA of the weights on and off, side by side.

    .venv/bin/python benchmarks/bench_ema.py            # ~1 min
    .venv/bin/python benchmarks/bench_ema.py --quick    # smoke run

A 16.8M-parameter stack of linear layers (the lean-state benchmark's shape) at 1 thread:
the optimizer step alone (the default container's fused AdamW on fixed gradients; the
mixed-precision container's flat step on fp32 masters) and a whole training step (forward and
backward of a batch, then the step), each contender its own copy, timed interleaved (order
reversed on odd repeats), medians of `--repeats`. The EMA updates every step unless said.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import markdown_table  # noqa: E402
from containers import (  # noqa: E402
    MixedPrecisionOptimizersContainer,
    MixedPrecisionSettings,
    OptimizersContainer,
    ShadowWeights,
)

KW = {"lr": 1e-3, "weight_decay": 0.1, "fused": True}
Build = Callable[[nn.Module], OptimizersContainer]


def _default(ema: ShadowWeights | None) -> Build:
    return lambda m: OptimizersContainer([m], torch.optim.AdamW, KW, ema=ema)


def _mixed(ema: ShadowWeights | None) -> Build:
    return lambda m: MixedPrecisionOptimizersContainer(
        [m], torch.optim.AdamW, KW, settings=MixedPrecisionSettings(), ema=ema
    )


# name -> (parameter dtype, container, baseline)
CONTENDERS: dict[str, tuple[torch.dtype, Build, str | None]] = {
    "AdamW, no EMA": (torch.float32, _default(None), None),
    "AdamW, EMA every step": (torch.float32, _default(ShadowWeights(0.999)), "AdamW, no EMA"),
    "AdamW, EMA every 10 steps": (
        torch.float32,
        _default(ShadowWeights(0.999, update_every_n_steps=10)),
        "AdamW, no EMA",
    ),
    "mixed precision, no EMA": (torch.bfloat16, _mixed(None), None),
    "mixed precision, EMA of the fp32 masters": (
        torch.bfloat16,
        _mixed(ShadowWeights(0.999)),
        "mixed precision, no EMA",
    ),
}


def _model(width: int, layers: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))).to(dtype)


def timings(width: int, layers: int, batch: int, repeats: int, steps: int) -> str:
    torch.set_num_threads(1)
    runs = {}
    for name, (dtype, build, _) in CONTENDERS.items():
        model = _model(width, layers, dtype)
        runs[name] = (model, build(model))
    params = list(runs[next(iter(runs))][0].parameters())
    numel = sum(p.numel() for p in params)
    grads = [torch.randn(p.shape) * 1e-2 for p in params]
    x = torch.randn(batch, width)
    step_times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    train_times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for r in range(repeats):
        for name in list(CONTENDERS) if r % 2 == 0 else list(reversed(CONTENDERS)):
            model, opt = runs[name]
            dtype = next(model.parameters()).dtype
            step = train = 0.0
            # Multiples of 10 steps: the 10-step cadence lands its usual share of updates.
            for k in range(steps + 1):  # the first makes the state
                for p, g in zip(model.parameters(), grads):
                    p.grad = g.to(p.dtype)
                start = time.perf_counter()
                opt.step()
                step += (time.perf_counter() - start) if k else 0.0
                start = time.perf_counter()
                opt.zero_grad()
                model(x.to(dtype)).float().square().mean().backward()
                opt.step()
                train += (time.perf_counter() - start) if k else 0.0
            step_times[name].append(step / steps)
            train_times[name].append(train / steps)
    rows = []
    for name, (_, _, baseline) in CONTENDERS.items():
        cells = [name]
        for times in (step_times, train_times):
            t, t0 = statistics.median(times[name]), statistics.median(times[baseline or name])
            cells.append(f"{t * 1e3:.1f} ({t / t0:.2f}x)")
        rows.append(cells)
    head = (
        f"{numel / 1e6:.1f}M parameters ({layers} x Linear({width})), batch {batch}, 1 thread, "
        f"medians of {repeats} interleaved repeats of {steps} steps"
    )
    return f"{head}\n\n{markdown_table(rows, ('', 'optimizer step ms', 'training step ms'))}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="small sizes")
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.layers, args.batch, args.repeats, args.steps = 256, 2, 8, 2, 10
    print(timings(args.width, args.layers, args.batch, args.repeats, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
