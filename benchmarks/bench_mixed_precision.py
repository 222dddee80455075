"""Mixed-precision step: time vs an fp32 fused AdamW step, vs the seed's algorithm, and memory.

    .venv/bin/python benchmarks/bench_mixed_precision.py [--params 8e6] [--parts 8] [--quick]

Every contender runs in a fresh subprocess (peak resident memory is a per-process high-water
mark), on the same number of parameters in `--parts` parts of equal tensors, gradients set once:
- fp32: torch fused AdamW on fp32 parameters (the 28 bytes/param floor);
- container: MixedPrecisionOptimizersContainer on bf16 parameters, fp32 masters, static loss
  scale 1024 and max_norm 1 (so unscale and clip really run), fused AdamW;
- seed: LightRFT FSDPadaptOptimizer's algorithm, re-implemented faithfully: fp32 copies of all
  gradients first, an fp64 norm, a separate unscale pass, a separate clip pass, the optimizer,
  then a per-tensor copy back.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, run_fresh
from config import MixedPrecision
from containers import MixedPrecisionOptimizersContainer


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _model(n: int, parts: int, dtype: torch.dtype) -> list[nn.Module]:
    per = n // parts
    torch.manual_seed(0)
    models = []
    for i in range(parts):
        m = nn.Module()
        m.register_parameter(f"w{i}", nn.Parameter(torch.randn(per, dtype=dtype) * 0.02))
        models.append(m)
    return models


def _seed_step(pairs, opt: torch.optim.Optimizer, scale: float, max_norm: float) -> None:
    """The seed's step: every gradient copied to fp32, fp64 norm, unscale, clip, copy back."""
    for p, m in pairs:
        m.grad = p.grad.float()
    norm = torch.stack([m.grad.double().norm() for _, m in pairs]).norm()  # fp64 copies
    if not torch.isfinite(norm):
        return
    for _, m in pairs:
        m.grad.mul_(1.0 / scale)
    coef = max_norm / (norm.item() / scale + 1e-6)
    if coef < 1:
        for _, m in pairs:
            m.grad.mul_(coef)
    opt.step()
    for p, m in pairs:
        p.data.copy_(m.data)
        m.grad = None


def _state_bytes(optimizers: list[torch.optim.Optimizer]) -> int:
    return sum(
        v.numel() * v.element_size()
        for opt in optimizers
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )


def _hwm_reset() -> int:
    """Reset the peak resident set to the current one; return the current one."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss()


def _hwm() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def child(kind: str, n: int, parts: int, steps: int) -> dict[str, float]:
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    models = _model(n, parts, dtype)
    params = [p for m in models for p in m.parameters()]
    grads = [torch.randn_like(p) * 1e-2 for p in params]
    kw = {"lr": 1e-4, "fused": True}
    masters: list[torch.Tensor] = []
    if kind == "fp32":
        opt = torch.optim.AdamW(params, **kw)
        optimizers, step = [opt], opt.step
    elif kind in ("container", "compiled"):
        settings = MixedPrecision(
            loss_scaling="static", initial_scale=1024.0, compile=kind == "compiled"
        )
        opt = MixedPrecisionOptimizersContainer(
            models, torch.optim.AdamW, kw, max_norm=1.0, settings=settings
        )
        optimizers, step = opt.optimizers, opt.step
        masters = [m for o in opt for g in o.param_groups for m in g["params"]]
    else:
        masters = [p.detach().float() for p in params]
        opt = torch.optim.AdamW(masters, **kw)
        pairs = list(zip(params, masters))
        optimizers = [opt]

        def step() -> None:
            _seed_step(pairs, opt, 1024.0, 1.0)

    times = []
    for i in range(steps):
        for p, g in zip(params, grads):
            p.grad = g
        if i == 1:  # after the first step (state allocated, kernels compiled)
            steady = sum(t.nbytes for t in [*params, *grads, *masters]) + _state_bytes(optimizers)
            before = _hwm_reset()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    # Steady bytes (parameters, gradients, masters, state) plus what a step adds at its peak.
    peak_extra = max(0, _hwm() - before)
    return {"step_s": statistics.median(times[1:]), "bytes_per_param": (steady + peak_extra) / n}


def run(kind: str, args: argparse.Namespace) -> dict[str, float]:
    argv = ["--child", kind, "--params", str(args.params), "--parts", str(args.parts)]
    return run_fresh(__file__, [*argv, "--steps", str(args.steps)])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", type=float, default=8e6)
    parser.add_argument("--parts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.params = int(1e5 if args.quick else args.params)
    if args.child:
        print(json.dumps(child(args.child, args.params, args.parts, args.steps)))
        return
    kinds = ("fp32", "container", "compiled", "seed")
    runs = {k: [] for k in kinds}
    for _ in range(2):  # alternate, fresh processes
        for kind in kinds:
            runs[kind].append(run(kind, args))
    t = {k: min(r["step_s"] for r in v) for k, v in runs.items()}
    mem = {k: min(r["bytes_per_param"] for r in v) for k, v in runs.items()}
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.params / 1e6:.0f}M "
        f"params in {args.parts} parts, AdamW fused; best of 2 fresh processes each"
    )
    rows = [
        ("fp32 fused AdamW step", f"{t['fp32'] * 1e3:.1f} ms", "", ""),
        (
            "container step / fp32 step",
            f"{t['container'] * 1e3:.1f} ms",
            f"{t['container'] / t['fp32']:.2f}",
            "<= 1.2",
        ),
        (
            "compiled container step / fp32 step",
            f"{t['compiled'] * 1e3:.1f} ms",
            f"{t['compiled'] / t['fp32']:.2f}",
            "<= 1.2",
        ),
        (
            "seed step / container step",
            f"{t['seed'] * 1e3:.1f} ms",
            f"{t['seed'] / t['container']:.2f}",
            ">= 2",
        ),
        ("seed step / compiled container step", "", f"{t['seed'] / t['compiled']:.2f}", ">= 2"),
        ("peak step memory, fp32 AdamW", f"{mem['fp32']:.1f} B/param", "", ""),
        ("peak step memory, container", f"{mem['container']:.1f} B/param", "", "<= 16"),
        ("peak step memory, compiled container", f"{mem['compiled']:.1f} B/param", "", "<= 16"),
        ("peak step memory, seed", f"{mem['seed']:.1f} B/param", "", ""),
    ]
    print(markdown_table(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
