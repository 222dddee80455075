"""Lean optimizer state: AdamW's moments in fp32 vs bf16, memory, step time and quality.

    .venv/bin/python benchmarks/bench_lean_state.py                 # table + quality, seeds 0-2
    .venv/bin/python benchmarks/bench_lean_state.py --no-quality    # the table only (~1 min)
    .venv/bin/python benchmarks/bench_lean_state.py --quick         # smoke run

Table: the default container over a 16.8M-parameter stack of linear layers (the mixed-
precision benchmark's shape), AdamW with `moment_dtype` "float32" (today's) and "bfloat16",
each its own copy stepped on the same gradients, timed interleaved (order reversed on odd
repeats) at 1 thread, medians of `--repeats`. Steady bytes per parameter count the optimizer
state tensors the container keeps between steps (the 4-byte step counts included).

Quality: the debug job (`train.py --nproc_per_node 2`, FSDP2 over 2 gloo ranks), 200 steps,
seeds 0-2, the mean loss of steps 181-200, fp32 moments against bf16 moments.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_mp_quality import run_job, tail_mean  # noqa: E402
from benchmarks.common import markdown_table  # noqa: E402
from containers import OptimizersContainer  # noqa: E402
from containers.norm import local  # noqa: E402

POLICIES = {"float32": "fp32 moments (today)", "bfloat16": "bf16 moments"}
DEBUG = ["--job.config_file", "config/debug.toml"]


def _model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def _state_bytes(opt: OptimizersContainer) -> int:
    return sum(
        local(v).numel() * local(v).element_size()
        for inner in opt
        for st in inner.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )


def step_table(width: int, layers: int, repeats: int, steps: int) -> str:
    torch.set_num_threads(1)
    runs = {}
    for dtype in POLICIES:
        model = _model(width, layers)
        opt = OptimizersContainer(
            [model], torch.optim.AdamW if dtype == "float32" else _lean(), _kwargs(dtype)
        )
        runs[dtype] = (model, opt)
    numel = sum(p.numel() for p in runs["float32"][0].parameters())
    grads = [torch.randn_like(p) for p in runs["float32"][0].parameters()]
    times: dict[str, list[float]] = {d: [] for d in POLICIES}
    for r in range(repeats):
        order = list(POLICIES) if r % 2 == 0 else list(reversed(POLICIES))
        for dtype in order:
            model, opt = runs[dtype]
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            opt.step()  # the state exists from the first step on
            start = time.perf_counter()
            for _ in range(steps):
                opt.step()
            times[dtype].append((time.perf_counter() - start) / steps)
    base = statistics.median(times["float32"])
    rows = []
    for dtype, name in POLICIES.items():
        per = _state_bytes(runs[dtype][1]) / numel
        t = statistics.median(times[dtype])
        goal = "<= 4.2 B/param" if dtype == "bfloat16" else ""
        rows.append((f"{name}: state bytes/param", f"{per:.2f}", f"{per / 8.0:.2f}x", goal))
        goal = "<= 1.00x" if dtype == "bfloat16" else ""
        rows.append((f"{name}: step ms", f"{t * 1e3:.2f}", f"{t / base:.2f}x", goal))
    head = f"AdamW, {numel / 1e6:.1f}M parameters ({layers} x Linear({width})), 1 thread"
    return f"{head}\n\n{markdown_table(rows)}"


def _lean() -> type:
    from containers import LeanAdamW

    return LeanAdamW


def _kwargs(dtype: str) -> dict:
    kwargs = {"lr": 1e-3, "weight_decay": 0.1, "fused": True}
    return kwargs if dtype == "float32" else {**kwargs, "moment_dtype": dtype}


def quality_table(args: argparse.Namespace) -> str:
    means: dict[str, list[float]] = {d: [] for d in POLICIES}
    lines = [
        f"debug job, {args.steps} steps, mean loss of the last {args.window}, 2 gloo ranks",
        "",
        "| seed | fp32 moments | bf16 moments | bf16 / fp32 |",
        "| --- | --- | --- | --- |",
    ]
    for seed in args.seeds:
        loss = {}
        for dtype in POLICIES:
            argv = [*DEBUG, "--optimizer.moment_dtype", dtype]
            loss[dtype] = tail_mean(run_job(f"adamw-{dtype}", seed, 1, args, argv), args.window)
            means[dtype].append(loss[dtype])
        f32, b16 = loss["float32"], loss["bfloat16"]
        lines.append(f"| {seed} | {f32:.4f} | {b16:.4f} | {b16 / f32:.4f} |")
    f32, b16 = (statistics.fmean(means[d]) for d in POLICIES)
    lines.append(f"| mean | {f32:.4f} | {b16:.4f} | **{b16 / f32:.4f}** (goal within 1%) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--step-repeats", type=int, default=5, help="steps timed per repeat")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--no-quality", action="store_true")
    parser.add_argument("--quick", action="store_true", help="small sizes, 6 steps")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "bench_lean_state"))
    args = parser.parse_args(argv)
    args.nproc, args.local_batch_size = 2, 0
    if args.quick:
        args.width, args.layers, args.repeats, args.step_repeats = 256, 2, 2, 2
        args.seeds, args.steps, args.window = [0], 6, 3
    print(step_table(args.width, args.layers, args.repeats, args.step_repeats), flush=True)
    if not args.no_quality:
        print()
        print(quality_table(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
