"""Mixed-precision step: time vs an fp32 fused AdamW step, vs the seed's algorithm, and memory.

    .venv/bin/python benchmarks/bench_mixed_precision.py [--layers 32] [--dim 128] [--quick]
    .venv/bin/python benchmarks/bench_mixed_precision.py --flat [--params 8e6] [--parts 8]

Every contender runs in a fresh subprocess (peak resident memory is a per-process high-water
mark), on the same parameters, each step given fresh gradients (as backward would: the step
may free them). The default parameter set is transformer-like: an embedding, per layer
wq/wk/wv/wo (dim x dim), w1/w3 (hidden x dim), w2 (dim x hidden) and two norm vectors, a final
norm and an output projection, split into `--parts` model parts (hundreds of tensors of mixed
sizes); `--flat` gives `--parts` equal flat tensors instead.
- fp32: torch fused AdamW on fp32 parameters (the 28 bytes/param floor);
- container: MixedPrecisionOptimizersContainer on bf16 parameters, fp32 masters, static loss
  scale 1024 and max_norm 1 (so unscale and clip really run), fused AdamW; eager and compiled
  (`LeanAdamW(compiled=True)`, what `implementation = "compiled"` builds: one inductor pass
  over each flat group, `containers.precision.flat_adam`);
- seed: LightRFT FSDPadaptOptimizer's algorithm, re-implemented faithfully: fp32 copies of all
  gradients first, an fp64 norm, a separate unscale pass, a separate clip pass, the optimizer,
  then a per-tensor copy back;
- in backward: forward + backward + step peak memory of a small bf16 model with the mixed
  precision container stepping after backward, and with `containers.InBackward` (loss scaling
  'none', no clip), which frees each unit's bf16 gradients inside backward.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
from torch.optim import AdamW

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, peak_rss, reset_peak_rss, run_fresh, train_peak
from containers import (
    InBackward,
    LeanAdamW,
    MixedPrecisionOptimizersContainer,
    MixedPrecisionSettings,
    norm,
)


def _flat(n: int, parts: int, dtype: torch.dtype) -> list[nn.Module]:
    per = n // parts
    models = []
    for i in range(parts):
        m = nn.Module()
        m.register_parameter(f"w{i}", nn.Parameter(torch.randn(per, dtype=dtype) * 0.02))
        models.append(m)
    return models


def _transformer(args: argparse.Namespace, dtype: torch.dtype) -> list[nn.Module]:
    """Transformer-shaped parameters (no forward): the layers split evenly over the parts,
    the embedding in the first, the final norm and output in the last."""
    d, h = args.dim, args.hidden

    def p(*shape: int) -> nn.Parameter:
        return nn.Parameter(torch.randn(*shape, dtype=dtype) * 0.02)

    models = [nn.Module() for _ in range(args.parts)]
    models[0].register_parameter("tok_embeddings", p(args.vocab, d))
    for i in range(args.layers):
        layer = nn.Module()
        for name in ("wq", "wk", "wv", "wo"):
            layer.register_parameter(name, p(d, d))
        layer.register_parameter("w1", p(h, d))
        layer.register_parameter("w3", p(h, d))
        layer.register_parameter("w2", p(d, h))
        layer.register_parameter("attention_norm", p(d))
        layer.register_parameter("ffn_norm", p(d))
        models[i * args.parts // args.layers].add_module(f"layer{i}", layer)
    models[-1].register_parameter("norm", p(d))
    models[-1].register_parameter("output", p(args.vocab, d))
    return models


def _model(args: argparse.Namespace, dtype: torch.dtype) -> list[nn.Module]:
    torch.manual_seed(0)
    return _flat(args.params, args.parts, dtype) if args.flat else _transformer(args, dtype)


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


def _build(kind: str, args: argparse.Namespace) -> tuple[list, list, Callable[[], None], list]:
    """One contender: its parameters, their gradients, its step and its optimizers."""
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    models = _model(args, dtype)
    params = [p for m in models for p in m.parameters()]
    grads = [torch.randn_like(p) * 1e-2 for p in params]
    kw = {"lr": 1e-4, "fused": True}
    if kind == "fp32":
        opt = torch.optim.AdamW(params, **kw)
        return params, grads, opt.step, [opt]
    if kind in ("container", "compiled"):
        settings = MixedPrecisionSettings(loss_scaling="static", initial_scale=1024.0)
        cls, kw = (LeanAdamW, {**kw, "compiled": True}) if kind == "compiled" else (AdamW, kw)
        opt = MixedPrecisionOptimizersContainer(models, cls, kw, max_norm=1.0, settings=settings)
        return params, grads, opt.step, opt.optimizers
    masters = [p.detach().float() for p in params]
    opt = torch.optim.AdamW(masters, **kw)
    pairs = list(zip(params, masters))
    return params, grads, lambda: _seed_step(pairs, opt, 1024.0, 1.0), [opt]


def _fresh_grads(params: list, grads: list) -> None:
    for p in params:
        p.grad = None  # so no old gradient and its fresh copy coexist
    for p, g in zip(params, grads):
        p.grad = g.clone()  # fresh, as backward gives: the step may free it


def _timed_step(params: list, grads: list, step: Callable[[], None]) -> float:
    _fresh_grads(params, grads)
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def child(kind: str, args: argparse.Namespace) -> dict[str, float]:
    if kind.startswith("fwd_bwd"):
        return _fwd_bwd(kind, args)
    if kind == "timing":
        return _interleaved(args)
    if kind == "compiled":  # inductor's cache cold: what a new job pays
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()
    params, grads, step, optimizers = _build(kind, args)
    masters = [m for o in optimizers for g in o.param_groups for m in g["params"]]
    masters = [m for m in masters if m.dtype != params[0].dtype]  # fp32 has none
    n = sum(p.numel() for p in params)
    times = []
    for i in range(args.steps):
        _fresh_grads(params, grads)
        if i == 1:  # after the first step (state allocated, kernels compiled)
            steady = sum(t.nbytes for t in [*params, *grads, *masters]) + _state_bytes(optimizers)
            fixed = sum(b.nbytes for b in norm._scratch.values())  # kept between steps
            before = reset_peak_rss()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    # Steady bytes (parameters, gradients, masters, state) plus what a step adds at its peak;
    # the scratch buffer, fixed in size, apart.
    peak_extra = max(0, peak_rss() - before)
    return {
        "step_s": statistics.median(times[1:]),
        "first_s": times[0],
        "bytes_per_param": (steady + peak_extra) / n,
        "fixed_bytes": fixed,
        "params": n,
        "tensors": len(params),
    }


def _interleaved(args: argparse.Namespace) -> dict[str, float]:
    """Step times of all contenders in one process, their steps taken in turn, so that a
    machine whose speed drifts (a shared VM) slows every contender alike: the median of each."""
    kinds = ["fp32", "container", "compiled", "seed"]
    built = {k: _build(k, args) for k in kinds}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.steps * 2):
        for k in kinds:
            times[k].append(_timed_step(*built[k][:3]))
    return {k: statistics.median(v[2:]) for k, v in times.items()}


def _fwd_bwd(kind: str, args: argparse.Namespace) -> dict[str, float]:
    """Peak resident memory of forward + backward + step of a small bf16 model: the mixed
    precision container alone, or stepping each unit inside backward."""
    torch.manual_seed(0)
    width = args.fb_width
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(args.fb_layers)))
    model = model.to(torch.bfloat16)
    settings = MixedPrecisionSettings(loss_scaling="none")
    timing = InBackward() if kind == "fwd_bwd_in_backward" else None
    opt = MixedPrecisionOptimizersContainer(
        [model], torch.optim.AdamW, {"lr": 1e-4, "fused": True}, settings=settings, timing=timing
    )
    return train_peak(model, opt, torch.randn(4, width, dtype=torch.bfloat16), args.steps)


def run(kind: str, args: argparse.Namespace) -> dict[str, float]:
    argv = ["--child", kind, "--steps", str(args.steps), "--parts", str(args.parts)]
    argv += ["--params", str(args.params), "--layers", str(args.layers), "--dim", str(args.dim)]
    argv += ["--hidden", str(args.hidden), "--vocab", str(args.vocab)]
    argv += ["--fb-width", str(args.fb_width), "--fb-layers", str(args.fb_layers)]
    argv += ["--flat"] if args.flat else []
    return run_fresh(__file__, argv, for_memory=kind != "timing")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--flat", action="store_true", help="--parts equal flat tensors")
    parser.add_argument("--params", type=float, default=8e6, help="with --flat")
    parser.add_argument("--parts", type=int, default=4)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=352)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--fb-width", type=int, default=1024, help="fwd+bwd model width")
    parser.add_argument("--fb-layers", type=int, default=8, help="fwd+bwd model depth")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--before",
        help="a checkout of an earlier commit (e.g. `git worktree add /tmp/before REV`): its "
        "step times, taken by its own copy of this script, beside today's",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.params, args.layers, args.dim, args.hidden, args.vocab = 1e5, 2, 32, 64, 256
        args.fb_width, args.fb_layers, args.steps = 128, 2, 3
    args.params = int(args.params)
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    kinds = ["timing", "fp32", "container", "compiled", "seed", "fwd_bwd", "fwd_bwd_in_backward"]
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for _ in range(1 if args.quick else 2):  # alternate, fresh processes
        for kind in kinds:
            runs[kind].append(run(kind, args))
    print(_describe(args, runs["fp32"][0]))
    print(markdown_table(_rows(runs)))
    if args.before:
        print(markdown_table(_before_rows(args, runs["timing"])))


def _before_rows(
    args: argparse.Namespace, now: list[dict[str, float]]
) -> list[tuple[str, str, str, str]]:
    """Step times / fp32 of the checkout `args.before` (its own script, interleaved as here)
    and of today's code, run alternately in fresh processes."""
    script = str(Path(args.before) / "benchmarks" / Path(__file__).name)
    argv = ["--child", "timing", "--steps", str(args.steps), "--parts", str(args.parts)]
    argv += ["--params", str(args.params), "--layers", str(args.layers), "--dim", str(args.dim)]
    argv += ["--hidden", str(args.hidden), "--vocab", str(args.vocab)]
    argv += ["--flat"] if args.flat else []
    old = [run_fresh(script, argv, for_memory=False) for _ in now]
    rows = []
    for kind in ("container", "compiled"):
        b = min(r[kind] / r["fp32"] for r in old)
        a = min(r[kind] / r["fp32"] for r in now)
        goal = "<= 1.1 on a GPU" if kind == "compiled" else "<= 2.2 (CPU), <= 1.3 (GPU)"
        rows.append((f"{kind} step / fp32 step: before -> now", f"{b:.2f} -> {a:.2f}", "", goal))
    return rows


def _describe(args: argparse.Namespace, fp32: dict[str, float]) -> str:
    shape = (
        f"{args.parts} flat tensors"
        if args.flat
        else f"{int(fp32['tensors'])} tensors (transformer-like: {args.layers} layers, dim "
        f"{args.dim}, hidden {args.hidden}, vocab {args.vocab})"
    )
    return (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{fp32['params'] / 1e6:.1f}M params in {shape}, {args.parts} parts, AdamW fused; "
        "step times: medians of one process stepping all contenders in turn, best of 2 such "
        f"processes; memory: a fresh process each; load average {os.getloadavg()[0]:.1f}"
    )


def _rows(runs: dict[str, list[dict[str, float]]]) -> list[tuple[str, str, str, str]]:
    t = {k: min(r[k] for r in runs["timing"]) for k in runs["timing"][0]}
    ms = {k: f"{v * 1e3:.1f} ms" for k, v in t.items()}
    mem = {k: min(r.get("bytes_per_param", 0.0) for r in v) for k, v in runs.items() if k in t}
    fixed = {k: max(r.get("fixed_bytes", 0) for r in v) for k, v in runs.items() if k in t}

    def per_param(kind: str) -> str:
        extra = f" + {fixed[kind] / 2**20:.0f} MiB" if fixed[kind] else ""
        return f"{mem[kind]:.1f} B/param{extra}"

    rows = [
        ("fp32 fused AdamW step", ms["fp32"], "", ""),
        (
            "container step (eager) / fp32 step",
            ms["container"],
            f"{t['container'] / t['fp32']:.2f}",
            "<= 2.2 (CPU), <= 1.3 (GPU)",
        ),
        (
            "seed step / container step (eager)",
            ms["seed"],
            f"{t['seed'] / t['container']:.2f}",
            ">= 2",
        ),
        ("peak step memory, fp32 AdamW", per_param("fp32"), "", ""),
        ("peak step memory, container (eager)", per_param("container"), "", "<= 16"),
        ("peak step memory, seed", per_param("seed"), "", ""),
    ]
    if "compiled" in t:
        first = max(r["first_s"] for r in runs["compiled"])  # the cold-cache first step
        rows[2:2] = [
            (
                "compiled container step / fp32 step",
                ms["compiled"],
                f"{t['compiled'] / t['fp32']:.2f}",
                "<= 1.1 (GPU)",
            ),
            ("seed step / compiled container step", "", f"{t['seed'] / t['compiled']:.2f}", ">= 2"),
            ("compiling (first compiled step, cold cache)", f"{first:.1f} s", "", ""),
        ]
        rows.append(("peak step memory, compiled container", per_param("compiled"), "", "<= 16"))
    peak = {k: min(r["peak_rss"] for r in runs[k]) for k in ("fwd_bwd", "fwd_bwd_in_backward")}
    grad_bytes = runs["fwd_bwd"][0]["grad_bytes"]
    saved = (peak["fwd_bwd"] - peak["fwd_bwd_in_backward"]) / grad_bytes
    rows += [
        ("fwd+bwd+step peak RSS, mixed precision", f"{peak['fwd_bwd'] / 2**20:.0f} MiB", "", ""),
        (
            "fwd+bwd+step peak RSS, in-backward x mixed precision",
            f"{peak['fwd_bwd_in_backward'] / 2**20:.0f} MiB",
            "",
            "",
        ),
        (
            "memory saved / bf16 gradient bytes",
            f"{grad_bytes / 2**20:.0f} MiB grads",
            f"{saved:.2f}",
            ">= 0.9",
        ),
    ]
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
