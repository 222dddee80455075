"""Lean optimizer state: AdamW's moments in fp32, bf16 or 8-bit codes, memory, step time and
quality.

    .venv/bin/python benchmarks/bench_lean_state.py                 # table + quality, seeds 0-2
    .venv/bin/python benchmarks/bench_lean_state.py --no-quality    # the table only (~1 min)
    .venv/bin/python benchmarks/bench_lean_state.py --quick         # smoke run
    .venv/bin/python benchmarks/bench_lean_state.py --graphs        # the compiled update alone
    .venv/bin/python benchmarks/bench_lean_state.py --slope         # train.py's job, B/param

Table: the default container over a 16.8M-parameter stack of linear layers (the mixed-
precision benchmark's shape), AdamW with `moment_dtype` "float32" (today's), "bfloat16", "8bit",
each its own copy stepped on the same gradients, timed interleaved (order reversed on odd
repeats) at 1 thread, medians of `--repeats`. Steady bytes per parameter count the optimizer
state tensors the container keeps between steps (the 4-byte step counts included).

Quality: the debug job (`train.py --nproc_per_node 2`, FSDP2 over 2 gloo ranks), 200 steps,
seeds 0-2, the mean loss of steps 181-200, fp32 moments against bf16 moments (and 8-bit).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_mp_quality import run_job, tail_mean  # noqa: E402
from benchmarks.common import markdown_table, peak_rss, reset_peak_rss, rss, run_fresh  # noqa: E402
from components.checkpoint import ModelWrapper  # noqa: E402
from containers import (  # noqa: E402
    LeanAdamW,
    MixedPrecisionOptimizersContainer,
    OptimizersContainer,
    load_planner,
)
from containers import MixedPrecisionSettings as MixedPrecision  # noqa: E402
from containers.tensors import SCRATCH_NUMEL, local  # noqa: E402

POLICIES = {"float32": "fp32 moments (today)", "bfloat16": "bf16 moments"}
DEBUG = ["--job.config_file", "config/debug.toml"]
MP_DEBUG = ["--job.config_file", "config/mixed_precision.toml"]
LEAN_MP = ["--optimizer.moment_dtype", "bfloat16", "--mixed_precision.store_param_remainders"]


def _model(width: int, layers: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))).to(dtype)


def _default(
    lean: bool, moments: str = "bfloat16", compiled: bool = False
) -> Callable[[nn.Module], OptimizersContainer]:
    kwargs = {"lr": 1e-3, "weight_decay": 0.1, "fused": True}
    if lean:
        lean_kwargs = {**kwargs, "moment_dtype": moments, "compiled": compiled}
        return lambda m: OptimizersContainer([m], LeanAdamW, lean_kwargs)
    return lambda m: OptimizersContainer([m], torch.optim.AdamW, kwargs)


def _mixed(lean: bool, moments: str = "bfloat16") -> Callable[[nn.Module], OptimizersContainer]:
    kwargs = {"lr": 1e-3, "weight_decay": 0.1, "fused": True}
    settings = MixedPrecision(store_param_remainders=lean)
    cls = LeanAdamW if lean else torch.optim.AdamW
    kwargs = {**kwargs, "moment_dtype": moments} if lean else kwargs
    return lambda m: MixedPrecisionOptimizersContainer([m], cls, kwargs, settings=settings)


# name -> (parameter dtype, container, baseline, goals: state B/param, params + state B/param,
# step time against the baseline's)
TODAY, MP_TODAY = "AdamW, fp32 moments", "mixed precision, fp32 masters + moments"
CONTENDERS = {
    TODAY: (torch.float32, _default(False), None, ("", "", "")),
    "AdamW, bf16 moments": (torch.float32, _default(True), TODAY, ("<= 4.2", "", "<= 1.45x")),
    "AdamW, 8-bit moments": (
        torch.float32, _default(True, "8bit"), TODAY, ("<= 4.2", "", "<= 15x")
    ),
    "AdamW, 8-bit moments, compiled": (
        torch.float32, _default(True, "8bit", compiled=True), TODAY, ("", "", "<= 5x")
    ),
    "AdamW, 4-bit moments": (torch.float32, _default(True, "4bit"), TODAY, ("", "", "")),
    "AdamW, 4-bit moments, compiled": (
        torch.float32, _default(True, "4bit", compiled=True), TODAY, ("", "", "")
    ),
    MP_TODAY: (torch.bfloat16, _mixed(False), None, ("", "", "")),
    "mixed precision, remainders + bf16 moments": (
        torch.bfloat16, _mixed(True), MP_TODAY, ("", "<= 8.5", "<= 1.9x")
    ),
    "mixed precision, remainders + 8-bit moments": (
        torch.bfloat16, _mixed(True, "8bit"), MP_TODAY, ("", "<= 6.3", "")
    ),
    "mixed precision, remainders + 4-bit moments": (
        torch.bfloat16, _mixed(True, "4bit"), MP_TODAY, ("", "", "")
    ),
}  # fmt: skip


def steady_bytes(model: nn.Module, opt: OptimizersContainer) -> tuple[int, int]:
    """(bytes of the parameters, bytes the container keeps between steps): every storage
    that its masters, state and flat buffers hold, counted once (state entries are views of
    flat buffers under mixed precision)."""
    tensors = [
        *(m for g in opt.param_groups for m in g["params"]),
        *(v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)),
        # 8-bit moments: a code and a scale each
        *(t for st in opt.state.values() for v in st.values() if isinstance(v, dict)
          for t in v.values()),
    ]  # fmt: skip
    flats = getattr(opt.precision, "_flat", {})
    tensors += [b for groups in flats.values() for flat in groups for b in flat.buffers.values()]
    params = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}
    for t in tensors:
        storage = local(t).untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(local(p).nbytes for p in model.parameters()), sum(storages.values())


def step_table(width: int, layers: int, repeats: int, steps: int) -> str:
    torch.set_num_threads(1)
    runs = {}
    for name, (dtype, build, *_) in CONTENDERS.items():
        model = _model(width, layers, dtype)
        runs[name] = (model, build(model))
    numel = sum(p.numel() for p in runs[next(iter(runs))][0].parameters())
    grads = [torch.randn(p.shape) * 1e-2 for p in runs[next(iter(runs))][0].parameters()]
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for r in range(repeats):
        order = list(CONTENDERS) if r % 2 == 0 else list(reversed(CONTENDERS))
        for name in order:
            model, opt = runs[name]
            elapsed = 0.0
            for k in range(steps + 1):  # the first makes the state
                for p, g in zip(model.parameters(), grads):
                    p.grad = g.to(p.dtype)  # fresh, as backward gives: the step frees it
                start = time.perf_counter()
                opt.step()
                elapsed += (time.perf_counter() - start) if k else 0.0
            times[name].append(elapsed / steps)
    rows = []
    for name, (_, _, baseline, goals) in CONTENDERS.items():
        param_bytes, kept = steady_bytes(*runs[name])
        base_bytes, base_kept = steady_bytes(*runs[baseline or name])
        t, t0 = statistics.median(times[name]), statistics.median(times[baseline or name])
        rows.append(
            (
                name,
                f"{kept / numel:.2f} ({kept / base_kept:.2f}x) {goals[0]}".rstrip(),
                f"{(param_bytes + kept) / numel:.2f} "
                f"({(param_bytes + kept) / (base_bytes + base_kept):.2f}x) {goals[1]}".rstrip(),
                f"{t * 1e3:.2f} ({t / t0:.2f}x) {goals[2]}".rstrip(),
            )
        )
    head = (
        f"{numel / 1e6:.1f}M parameters ({layers} x Linear({width})), 1 thread, medians of "
        f"{repeats} interleaved repeats; the fp32 scratch buffer ({SCRATCH_NUMEL * 4 >> 20} MiB, "
        "fixed) and the gradients (freed by the step) apart"
    )
    columns = ("", "state B/param", "params + state B/param", "step ms")
    return f"{head}\n\n{markdown_table(rows, columns)}"


# name -> (job, the policy of today, the lean policy)
QUALITY = {
    "AdamW": (
        DEBUG,
        ["--optimizer.moment_dtype", "float32"],
        ["--optimizer.moment_dtype", "bfloat16"],
    ),
    "mixed precision": (MP_DEBUG, [], LEAN_MP),
    "AdamW, 8-bit": (
        DEBUG,
        ["--optimizer.moment_dtype", "float32"],
        ["--optimizer.moment_dtype", "8bit"],
    ),
    "mixed precision, remainders + 8-bit": (MP_DEBUG, [], [*LEAN_MP[:1], "8bit", *LEAN_MP[2:]]),
    "mixed precision, remainders + 4-bit": (MP_DEBUG, [], [*LEAN_MP[:1], "4bit", *LEAN_MP[2:]]),
}
# each job's runs, by the name its records are kept under (shared where the runs are the same)
RUN_NAMES = {
    "AdamW": ("adamw-float32", "adamw-bfloat16"),
    "mixed precision": ("mp-today", "mp-lean"),
    "AdamW, 8-bit": ("adamw-float32", "adamw-8bit"),
    "mixed precision, remainders + 8-bit": ("mp-today", "mp-lean-8bit"),
    "mixed precision, remainders + 4-bit": ("mp-today", "mp-lean-4bit"),
}


def quality_table(args: argparse.Namespace) -> str:
    lines = [
        f"debug job, {args.steps} steps, mean loss of the last {args.window}, 2 gloo ranks",
        "",
        "| job | seed | today's state | lean state | lean / today |",
        "| --- | --- | --- | --- | --- |",
    ]
    for job, (base, today, lean) in QUALITY.items():
        means: dict[str, list[float]] = {"today": [], "lean": []}
        for seed in args.seeds:
            loss = {}
            for policy, argv, name in zip(("today", "lean"), (today, lean), RUN_NAMES[job]):
                loss[policy] = tail_mean(run_job(name, seed, 1, args, [*base, *argv]), args.window)
                means[policy].append(loss[policy])
            t, lean_loss = loss["today"], loss["lean"]
            lines.append(f"| {job} | {seed} | {t:.4f} | {lean_loss:.4f} | {lean_loss / t:.4f} |")
        t, lean_loss = (statistics.fmean(means[p]) for p in ("today", "lean"))
        ratio = f"**{lean_loss / t:.4f}** (goal within 1%)"
        lines.append(f"| {job} | mean | {t:.4f} | {lean_loss:.4f} | {ratio} |")
    return "\n".join(lines)


# name -> the mixed-precision job's options (`MP_DEBUG` and these)
SLOPES = {
    MP_TODAY: [],
    "mixed precision, remainders + bf16 moments": LEAN_MP,
    "mixed precision, remainders + 8-bit moments": [*LEAN_MP[:1], "8bit", *LEAN_MP[2:]],
    "mixed precision, remainders + 4-bit moments": [*LEAN_MP[:1], "4bit", *LEAN_MP[2:]],
}
SLOPE_GOALS = {"mixed precision, remainders + 8-bit moments": "<= 6.3"}


def slope_child(argv: list[str]) -> None:
    """Rank body of `--slope-child` (under torchrun): the job train.py builds from `argv`,
    trained 4 steps as train.py's loop does, then rank 0 prints its local parameter count,
    the bytes of every tensor storage alive (each once) and its resident set, both after a
    collection and `malloc_trim` (freed heap pages leave the set) and less the model's
    buffers (rotary tables, which grow with a flavor's sequence length, not its parameters)."""
    import ctypes

    from components.job import build_job
    from config import load_job_config

    job = build_job(load_job_config(argv))
    for _ in range(4):
        job.optimizers.zero_grad()
        for _ in range(job.accumulation_steps):
            job.forward_backward(*next(job.dataloader))
        job.optimizers.step()
    job.optimizers.zero_grad()
    gc.collect()
    storages, buffers = {}, {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
            storage = local(obj).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    for b in (b for part in job.model_parts for b in part.buffers()):
        buffers[local(b).untyped_storage().data_ptr()] = local(b).untyped_storage().nbytes()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    out = {
        "params": sum(local(p).numel() for p in job.parameters()),
        "tensors": sum(storages.values()) - sum(buffers.values()),
        "rss": rss() - sum(buffers.values()),
    }
    job.close()
    if job.rank == 0:
        print(json.dumps(out))


def slope_table(flavors: tuple[str, str], nproc: int = 2) -> str:
    """Steady memory per parameter of the mixed-precision job at two llama sizes: the slope
    of what rank 0 keeps between steps, per local parameter (what grows with the model,
    whatever the run's fixed costs)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    rows = []
    for name, options in SLOPES.items():
        kept = {}
        for flavor in flavors:
            argv = [
                *MP_DEBUG, *options, "--model.flavor", flavor, "--checkpoint.enable", "false",
                "--training.local_batch_size", "1", "--training.seq_len", "32",  # (fast steps)
            ]  # fmt: skip
            script = ["--standalone", f"--nproc_per_node={nproc}", __file__, "--slope-child"]
            kept[flavor] = run_fresh(str(torchrun), [*script, *argv])
        small, large = (kept[f] for f in flavors)
        params = large["params"] - small["params"]
        tensors, resident = ((large[k] - small[k]) / params for k in ("tensors", "rss"))
        goal = SLOPE_GOALS.get(name, "")
        rows.append((name, f"{tensors:.2f} {goal}".rstrip(), f"{resident:.2f} {goal}".rstrip()))
    head = (
        f"the mixed-precision job as train.py builds it, {nproc} gloo ranks (FSDP2), llama "
        f"{flavors[0]} and {flavors[1]}, 4 steps; rank 0 after the last: the slope between "
        "the sizes per local parameter, of its live tensor storages and of its resident set "
        "(the model's buffers apart)"
    )
    columns = ("", "tensors B/param (slope)", "resident B/param (slope)")
    return f"{head}\n\n{markdown_table(rows, columns)}"


# name -> (parameter dtype, container, loaded through `containers.load_planner`)
RESUMES = {
    MP_TODAY: (torch.bfloat16, _mixed(False), False),
    "mixed precision, remainders + bf16 moments, load_planner": (
        torch.bfloat16, _mixed(True), True
    ),
    "mixed precision, remainders + bf16 moments, DCP's default planner": (
        torch.bfloat16, _mixed(True), False
    ),
    TODAY: (torch.float32, _default(False), True),
    "AdamW, 8-bit moments": (torch.float32, _default(True, "8bit"), True),
}  # fmt: skip


def resume_child(policy: str, path: str, width: int, layers: int) -> dict[str, float]:
    """One save to `path` and a resume from it in this fresh process: how far the resident
    set grows over the steady state while saving and while loading."""
    dtype, build, planned = RESUMES[policy]
    model = _model(width, layers, dtype)
    opt = build(model)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape) * 1e-2).to(dtype)
    opt.step()
    states = {"model": ModelWrapper([model]), "optim": opt}
    gc.collect()
    before = reset_peak_rss()
    dcp.save(states, checkpoint_id=path)
    saving = peak_rss() - before
    gc.collect()
    before = reset_peak_rss()
    with load_planner(states) if planned else contextlib.nullcontext() as planner:
        dcp.load(states, checkpoint_id=path, planner=planner)
    return {
        "saving": saving,
        "growth": peak_rss() - before,
        "largest": max(p.numel() for p in model.parameters()) * 4,  # one tensor, in fp32
        "steady": sum(steady_bytes(model, opt)),
        "params": sum(p.numel() for p in model.parameters()),
    }


def resume_table(width: int, layers: int) -> str:
    rows = []
    for policy in RESUMES:
        with tempfile.TemporaryDirectory() as tmp:
            argv = ["--resume-child", policy, tmp, "--width", str(width), "--layers", str(layers)]
            r = run_fresh(__file__, argv)
        rows.append(
            (
                policy,
                f"{r['steady'] / r['params']:.2f}",
                *(
                    f"{r[k] / 2**20:.1f} MiB ({r[k] / r['largest']:.2f} tensors)"
                    for k in ("saving", "growth")
                ),
            )
        )
    head = (
        f"save and resume, {width}x{width} x {layers}, fresh process each: "
        "resident set growth over the steady state while DCP saves, then loads (goal: <= one "
        "fp32 tensor, the largest: its 'tensors')"
    )
    columns = ("", "steady B/param", "save growth", "load growth")
    return f"{head}\n\n{markdown_table(rows, columns)}"


# name -> (parameter dtype or None: the masters are the parameters, master dtype or
# "remainders", moment dtype, gradient dtype)
GRAPHS = {
    "AdamW, fp32 moments": (None, torch.float32, torch.float32, torch.float32),
    "AdamW, bf16 moments": (None, torch.float32, torch.bfloat16, torch.float32),
    "mixed precision, fp32 masters + moments": (
        torch.bfloat16, torch.float32, torch.float32, torch.bfloat16
    ),
    "mixed precision, remainders + bf16 moments": (
        torch.bfloat16, "remainders", torch.bfloat16, torch.bfloat16
    ),
}  # fmt: skip


def graph_table(numel: int, repeats: int) -> str:
    """The compiled update alone (`containers.update.compiled`) over one tensor of `numel`
    for each kind of state, against `torch._fused_adamw_` in fp32, 1 thread, interleaved; and
    each graph with a 16-bit tensor once more with inductor's loop tiled at the bf16 vector
    width (a patch of inductor's choice, in this process only: a measurement of what its
    heuristic costs, not a path)."""
    import torch._inductor.codegen.cpp as cpp

    import containers.update.compiled as module
    from containers.update.driver import Slot, Update
    from containers.update.forms import MASTER_CODECS, MOMENT_CODECS

    torch.set_num_threads(1)
    torch._inductor.config.force_disable_caches = True  # the patched graphs are compiled anew
    settings = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, maximize=False)

    def graph(kind: str, compiled: Callable) -> Callable[[], None]:
        param_dtype, master_dtype, moment_dtype, grad_dtype = GRAPHS[kind]
        torch.manual_seed(0)
        value = torch.randn(numel)
        grad = (torch.randn(numel) * 1e-2).to(grad_dtype)
        moments = [(torch.rand(numel) * 1e-4).to(moment_dtype) for _ in range(2)]
        low, master = None, "param"
        if master_dtype == "remainders":
            low, master = value.bfloat16(), "remainders"
            value = torch.zeros(numel, dtype=torch.int16)
        elif param_dtype is not None:
            low, master = value.bfloat16(), "fp32"
        codec = MOMENT_CODECS[str(moment_dtype).removeprefix("torch.")]
        codecs = [("exp_avg", codec), ("exp_avg_sq", codec)]
        slot = Slot(value, grad, moments, torch.ones(()), low=low)

        def step() -> None:
            kept, module._graph = module._graph, lambda: compiled
            try:
                update = Update(MASTER_CODECS[master], codecs, settings, decoupled=True)
                module.step_compiled([slot], update)
            finally:
                module._graph = kept

        return step

    def fused() -> Callable[[], None]:
        torch.manual_seed(0)
        p, g, m, v = torch.randn(numel), torch.randn(numel) * 1e-2, *torch.rand(2, numel) * 1e-4
        kw = {**settings, "amsgrad": False}
        return lambda: torch._fused_adamw_([p], [g], [m], [v], [], [torch.ones(())], **kw)

    def forced(body: Any) -> tuple[torch.dtype | None, bool]:
        dtype, fp32 = heuristic(body)
        return (torch.bfloat16, fp32) if dtype is None else (dtype, fp32)

    # A new code object: dynamo keeps compiled code per code object, and this one's differs.
    adam = module._update_one
    tiled = type(adam)(adam.__code__.replace(co_name="_adam_bf16_tiles"), adam.__globals__)
    tiled = torch.compile(tiled, dynamic=True, fullgraph=True, options={"size_asserts": False})
    base = "torch._fused_adamw_, fp32 moments"
    runs = {base: fused()} | {kind: graph(kind, module._graph()) for kind in GRAPHS}
    patched = {f"{kind}, tiled at the bf16 width (patched)": graph(kind, tiled) for kind in GRAPHS}
    del patched["AdamW, fp32 moments, tiled at the bf16 width (patched)"]  # no 16-bit tensor
    heuristic = cpp.get_loop_body_lowp_fp
    cpp.get_loop_body_lowp_fp = forced
    try:
        for step in patched.values():
            step()  # compiled with the patch
    finally:
        cpp.get_loop_body_lowp_fp = heuristic
    runs |= patched
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(repeats):
        for name in list(runs) if r % 2 == 0 else list(reversed(runs)):
            start = time.perf_counter()
            for _ in range(5):
                runs[name]()
            times[name].append((time.perf_counter() - start) / 5)
    t0 = statistics.median(times[base])
    rows = [
        (name, f"{statistics.median(t) / numel * 1e9:.3f}", f"{statistics.median(t) / t0:.2f}")
        for name, t in times.items()
    ]
    head = f"the update alone over one tensor of {numel / 1e6:.1f}M elements, 1 thread"
    return f"{head}\n\n{markdown_table(rows, ('', 'ns/element', '/ fused fp32 AdamW'))}"


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
    parser.add_argument("--no-table", action="store_true", help="the quality runs only")
    parser.add_argument("--quick", action="store_true", help="small sizes, 6 steps")
    parser.add_argument(
        "--slope", action="store_true", help="steady memory of train.py's job at two sizes"
    )
    parser.add_argument(
        "--graphs", action="store_true", help="the compiled update's CPU code alone, then stop"
    )
    parser.add_argument("--out", default=str(ROOT / "outputs" / "bench_lean_state"))
    parser.add_argument("--resume-child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--slope-child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.slope_child:
        slope_child(args.slope_child)
        return 0
    if args.resume_child:
        print(json.dumps(resume_child(*args.resume_child, args.width, args.layers)))
        return 0
    if args.slope:
        flavors = ("tiny", "debug") if args.quick else ("debug", "small")
        print(slope_table(flavors))
        return 0
    if args.graphs:
        print(graph_table(2**18 if args.quick else 2**22, 2 if args.quick else 9))
        return 0
    args.nproc, args.local_batch_size = 2, 0
    if args.quick:
        args.width, args.layers, args.repeats, args.step_repeats = 256, 2, 2, 2
        args.seeds, args.steps, args.window = [0], 6, 3
    if not args.no_table:
        print(step_table(args.width, args.layers, args.repeats, args.step_repeats), flush=True)
        print()
        print(resume_table(args.width, args.layers), flush=True)
        print()
    if not args.no_quality:
        print(quality_table(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
