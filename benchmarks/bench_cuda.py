"""The CUDA paths, checked and timed on one GPU: what the CPU suite cannot show.

    python benchmarks/bench_cuda.py            # on a machine with a GPU (~1 min)
    python benchmarks/bench_cuda.py --quick    # tiny sizes; also runs on a CPU (a smoke run)
    python benchmarks/bench_cuda.py --profile  # where a compiled lean step's time goes, only

Checks (each a line, PASS or FAIL, none stops the others): the default container is torch's
fused AdamW bit for bit; a non-finite gradient element skips the step; the host syncs a
step makes; bf16 moments are torch's fused step on the widened moments, rounded back, and
whether torch's CUDA kernel takes them unwidened; remainders keep the fp32 masters bit for
bit; offload to pinned memory is readable at once and a reloaded step is bitwise.

Tables (CUDA-event times, medians of interleaved repeats): the default step with the
non-finite check on and off against one fused AdamW (issue 28's table), and the lean-state
table (steady bytes per parameter, step time) of `bench_lean_state.py`.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_lean_state import CONTENDERS, MP_TODAY, TODAY, steady_bytes  # noqa: E402
from benchmarks.common import markdown_table  # noqa: E402
from containers import (  # noqa: E402
    LeanAdamW,
    MixedPrecisionOptimizersContainer,
    OptimizersContainer,
    OptimizersInBackwardContainer,
)
from containers import MixedPrecisionSettings as MixedPrecision  # noqa: E402
from containers.norm import nonfinite_flag, sum_of_squares  # noqa: E402

KW = {"lr": 1e-3, "weight_decay": 0.1, "fused": True}


def check(name: str) -> Callable[[Callable[[torch.device], str]], Callable]:
    """Register the decorated check (a function of the device that returns its detail and
    raises on failure) under `name`; `main` runs them all."""

    def run(fn: Callable[[torch.device], str]) -> Callable:
        CHECKS.append((name, fn))
        return fn

    return run


CHECKS: list[tuple[str, Callable[[torch.device], str]]] = []


def _parts(device: torch.device, n: int, width: int, dtype=torch.float32) -> list[nn.Module]:
    """`n` parts of an MLP block each, under FQNs `layers.<i>.` (unique across parts)."""
    torch.manual_seed(0)
    parts = []
    for i in range(n):
        block = nn.Sequential(
            nn.Linear(width, 2 * width), nn.Linear(2 * width, width), nn.LayerNorm(width)
        )
        part = nn.Module()
        part.layers = nn.ModuleDict({str(i): block})
        parts.append(part.to(device=device, dtype=dtype))
    return parts


def _grads(parts: list[nn.Module], step: int) -> list[torch.Tensor]:
    g = torch.Generator(device=next(parts[0].parameters()).device).manual_seed(step)
    return [
        torch.randn(p.shape, generator=g, device=p.device).to(p.dtype) * 1e-2
        for m in parts
        for p in m.parameters()
    ]


def _give(parts: list[nn.Module], grads: list[torch.Tensor]) -> None:
    for p, g in zip((p for m in parts for p in m.parameters()), grads):
        p.grad = g.clone()


def _params(parts: list[nn.Module]) -> list[torch.Tensor]:
    return [p.detach().clone() for m in parts for p in m.parameters()]


def _state(opt: OptimizersContainer) -> list[torch.Tensor]:
    return [v.clone() for v in opt.state_dict().values() if torch.is_tensor(v)]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@check("default container == torch AdamW(fused=True), bitwise, 3 steps")
def _default_is_fused(device: torch.device) -> str:
    parts, ref_parts = _parts(device, 3, 64), _parts(device, 3, 64)
    opt = OptimizersContainer(parts, torch.optim.AdamW, KW)
    ref = torch.optim.AdamW([p for m in ref_parts for p in m.parameters()], **KW)
    for step in range(3):
        grads = _grads(parts, step)
        _give(parts, grads)
        _give(ref_parts, grads)
        opt.step()
        ref.step()
    assert _equal(_params(parts), _params(ref_parts)), "parameters differ"
    return "equal"


@check("a non-finite gradient element skips the step (inf and nan, any part)")
def _nonfinite_skips(device: torch.device) -> str:
    seen = []
    for part in range(3):
        for bad in (float("inf"), float("nan")):
            parts = _parts(device, 3, 64)
            opt = OptimizersContainer(parts, torch.optim.AdamW, KW)
            _give(parts, _grads(parts, 0))
            opt.step()
            before, state = _params(parts), _state(opt)
            _give(parts, _grads(parts, 1))
            grad = list(parts[part].parameters())[1].grad
            grad.view(-1)[grad.numel() // 2] = bad
            opt.step()
            assert _equal(before, _params(parts)), (part, bad, "parameters moved")
            assert _equal(state, _state(opt)), (part, bad, "state moved")
            assert opt.last_report.skipped, (part, bad, "not reported skipped")
            seen.append(bad)
    return f"{len(seen)} cases skipped"


@check("nonfinite_flag (fp32, bf16), candidates, fp64-squares norm: nan, inf, -inf found; 3e38 not")
def _flag(device: torch.device) -> str:
    seen = []
    # (the compiled candidate of the timing table too, on CUDA, where it is timed)
    flags = [nonfinite_flag, _aminmax_flag]
    if device.type == "cuda":
        flags += [_compiled_flag, _triton_flag]
    for bad, want in ((float("nan"), 1.0), (float("inf"), 1.0), (-float("inf"), 1.0), (3e38, 0.0)):
        for where in range(3):
            ts = [torch.randn(n, device=device) for n in (7, 1 << 20, 65537)]
            ts[where].view(-1)[ts[where].numel() - 1 - where] = bad
            for flag in flags:
                got = float(flag(ts, []))
                assert got == want, (flag.__name__, bad, where, got)
                seen.append(got)
            # bf16 gradients (CUDA's AMP check refuses them; the flag must not)
            for flag in (nonfinite_flag, _triton_flag) if device.type == "cuda" else ():
                got = float(flag([t.to(torch.bfloat16) for t in ts], []))
                assert got == want, (flag.__name__, "bf16", bad, where, got)
                seen.append(got)
            # The norm a clipped step's kernels skip on: squares in fp64, finite iff all are.
            for dtype in (torch.float32, torch.bfloat16):
                squares = sum_of_squares([t.to(dtype) for t in ts], device, exact=True)
                assert bool(squares.isfinite()) is (want == 0.0), (dtype, bad, where)
                seen.append(want)
    return f"{len(seen)} cases"


def _syncs(step: Callable[[], None]) -> tuple[int, str]:
    """The host syncs one call of `step` makes (after a first, untimed one), and where the
    first is."""
    step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    count = sum("called a synchronizing" in str(w.message) for w in caught)
    where = ""
    if count:  # where the first one is: "error" mode raises there
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        except RuntimeError as e:
            frames = traceback.extract_tb(e.__traceback__)[-4:]
            where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.line}" for f in frames)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return count, where


def _stepper(parts: list[nn.Module], opt: OptimizersContainer) -> Callable[[], None]:
    """A step on fresh gradients each call (a step may free them)."""
    calls = iter(range(1 << 30))

    def step() -> None:
        _give(parts, _grads(parts, next(calls)))
        opt.step()

    return step


@check("host syncs of one default step (torch.cuda sync debug mode)")
def _host_syncs(device: torch.device) -> str:
    if device.type != "cuda":
        return "no CUDA"
    found = {}
    for name, cls, kwargs in (
        ("check on", torch.optim.AdamW, {}),
        ("check off", torch.optim.AdamW, {"skip_nonfinite": False}),
        ("check on, compiled bf16 moments", LeanAdamW, {}),
        ("check on, clip (max_norm 1)", torch.optim.AdamW, {"max_norm": 1.0}),
    ):
        parts = _parts(device, 4, 64)
        lean = {"moment_dtype": "bfloat16", "compiled": True} if cls is LeanAdamW else {}
        opt = OptimizersContainer(parts, cls, {**KW, **lean}, **kwargs)
        found[name] = _syncs(_stepper(parts, opt))
    return "; ".join(f"{name}: {n} {where}".rstrip() for name, (n, where) in found.items())


@check("mixed precision (bf16, no clip; norm measured): host syncs of a step, eager, compiled")
def _mixed_precision_syncs(device: torch.device) -> str:
    if device.type != "cuda":
        return "no CUDA"
    found = {}
    for name, compile, keep, max_norm in (
        ("eager", False, False, None),
        ("compiled", True, False, None),
        ("compiled remainders", True, True, None),
        ("eager, max_norm 0 (the default: the norm measured)", False, False, 0.0),
        ("compiled, max_norm 0", True, False, 0.0),
    ):
        parts = _parts(device, 4, 64, torch.bfloat16)
        settings = MixedPrecision(store_param_remainders=keep)
        opt = MixedPrecisionOptimizersContainer(
            parts, LeanAdamW, {**KW, "compiled": compile}, settings=settings, max_norm=max_norm
        )
        found[name] = _syncs(_stepper(parts, opt))
    assert all(n == 0 for n, _ in found.values()), found
    return ", ".join(f"{name}: {n}" for name, (n, _) in found.items())


@check("compiled mixed precision: within rtol 1e-6 of eager (fp32 and bf16 moments)")
def _compiled_close(device: torch.device) -> str:
    if device.type != "cuda":
        return "no CUDA (the CPU suite's tests hold it there)"
    runs = {}
    for compile, keep, moments in (
        (False, False, "float32"),
        (True, False, "float32"),
        (True, False, "bfloat16"),
        (True, True, "bfloat16"),
    ):
        parts = _parts(device, 2, 64, torch.bfloat16)
        settings = MixedPrecision(store_param_remainders=keep)
        kwargs = {**KW, "moment_dtype": moments, "compiled": compile}
        opt = MixedPrecisionOptimizersContainer(parts, LeanAdamW, kwargs, settings=settings)
        for step in range(3):
            _give(parts, _grads(parts, step))
            opt.step()
        sd = opt.state_dict()
        runs[compile, keep, moments] = {k: v for k, v in sd.items() if torch.is_tensor(v)}

    def apart(a: dict, b: dict, keys: str = "") -> float:
        # (as torch.testing.assert_close with rtol 1e-6, atol 1e-8: a weight that started at
        # 0 is a sum of a few lr-sized updates, each a few fp32 ulp apart)
        return max(
            ((a[k].float() - v.float()).abs() / (1e-8 + 1e-6 * v.float().abs())).max().item()
            for k, v in b.items()
            if v.is_floating_point() and v.dim() and k.startswith(keys)
        )

    eager = apart(runs[True, False, "float32"], runs[False, False, "float32"])
    assert eager <= 1.0, f"compiled fp32 state {eager:.2f} x (1e-8 + 1e-6 |value|) from eager"
    lean, kept = runs[True, False, "bfloat16"], runs[True, True, "bfloat16"]
    # Two graphs: Triton may contract a multiply-add into an FMA in one and not the other.
    masters = apart(kept, lean, "master")
    assert masters <= 1.0, f"remainders' masters {masters:.2f} x (1e-8 + 1e-6 |value|) apart"
    same = sum(torch.equal(v, kept[k]) for k, v in lean.items())
    return (
        f"fp32 state {eager:.2f} x (1e-8 + 1e-6 |value|) from eager; remainders' masters "
        f"{masters:.2f} x that from fp32 masters' ({same}/{len(lean)} entries bitwise)"
    )


@check("in-backward: no host sync inside backward; the step's report makes one")
def _in_backward_syncs(device: torch.device) -> str:
    if device.type != "cuda":
        return "no CUDA"
    parts = _parts(device, 4, 64)
    opt = OptimizersInBackwardContainer(parts, torch.optim.AdamW, KW)
    x = torch.randn(8, 64, device=device)

    def loss() -> torch.Tensor:
        h = x
        for part in parts:
            h = next(iter(part.layers.values()))(h)
        return h.square().mean()

    opt.backward(loss())
    opt.step()
    counts = []
    for phase in ("backward", "step"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                opt.backward(loss()) if phase == "backward" else opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("called a synchronizing" in str(w.message) for w in caught))
    assert counts[0] == 0, counts
    assert opt.last_report.committed
    return f"backward {counts[0]}, step {counts[1]}"


def _against_fused(
    device: torch.device, shapes: list, moments: str, bf16_state: bool = False
) -> None:
    """LeanAdamW with `moments` against torch's fused AdamW whose moments are set, after each
    of 3 steps, to what the lean ones hold: parameters and held moments bitwise. With
    `bf16_state`, torch's AdamW keeps bf16 moments itself (made before its first step, as
    torchtitan's `fused_opt_states_bf16`), stepped by its own kernel."""
    from containers.update.forms import to_values

    torch.manual_seed(0)
    params = [torch.randn(s, device=device) for s in shapes]
    ref_params = [p.clone() for p in params]
    lean = LeanAdamW(params, lr=1e-2, weight_decay=0.1, moment_dtype=moments)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, fused=True)
    for q in ref_params if bf16_state else ():
        zeros = {n: torch.zeros_like(q, dtype=torch.bfloat16) for n in ("exp_avg", "exp_avg_sq")}
        ref.state[q] = {"step": torch.zeros((), device=device), **zeros}
    for step in range(3):
        for p, q in zip(params, ref_params):
            p.grad = torch.randn_like(p) * 1e-2
            q.grad = p.grad.clone()
        lean.step()
        ref.step()
        for p, q in zip(params, ref_params):
            assert torch.equal(p, q), step
            for name in ("exp_avg", "exp_avg_sq"):
                kept = lean.state[p][name]
                if moments == "bfloat16":
                    assert kept.dtype == torch.bfloat16
                ours = to_values(name, kept).float()
                if bf16_state:
                    assert torch.equal(ours, ref.state[q][name].float()), (step, name)
                    continue
                theirs = _held(name, ref.state[q][name], q, moments)
                assert torch.equal(ours, theirs), (step, name)
                ref.state[q][name].copy_(theirs)


def _held(name: str, values: torch.Tensor, p: torch.Tensor, moments: str) -> torch.Tensor:
    """What a group of `moments` holds of fp32 `values` (moment `name` of `p`), as fp32."""
    from containers.update.forms import MOMENT_CODECS, to_values

    if moments == "bfloat16":
        return values.bfloat16().float()
    return to_values(name, MOMENT_CODECS["8bit"].from_values(name, values, p)).float()


@check("bf16 moments == torch's fused AdamW over bf16 state, or else widened (3 steps)")
def _lean_is_torchs(device: torch.device) -> str:
    """Where torch's kernel takes bf16 moments (`moments.BF16_FUSED_DEVICES`), LeanAdamW is it;
    else the fused step on the widened moments, rounded back."""
    from containers.update.codecs import BF16_FUSED_DEVICES

    direct = device.type in BF16_FUSED_DEVICES
    _against_fused(device, [3000, 1 << 20, 77], "bfloat16", bf16_state=direct)
    return "equal: torch's kernel over bf16 state" if direct else "equal: widened"


@check("8-bit moments: decode, torch's fused kernel, encode, bitwise; codes as the CPU's")
def _coded_steps(device: torch.device) -> str:
    from containers.update import codes8 as moment_codes

    _against_fused(device, [(300, 100), (33,), (3, 5, 70)], "8bit")
    # The same values code alike here and on the CPU, but within a few ulp of the midpoint
    # between two log codes (where this device's log2 and the CPU's may round apart).
    v = torch.rand(64, 96, device=device) * torch.exp2(-40 * torch.rand(64, 96, device=device))
    here = [torch.empty(64, 96, dtype=torch.uint8, device=device)]
    here.append(torch.empty(64, 3, device=device))
    moment_codes.encode_log(v, *here)
    cpu = [t.cpu() for t in here]
    moment_codes.encode_log(v.cpu(), *cpu)
    assert torch.equal(here[1].cpu(), cpu[1])
    top = cpu[1].repeat_interleave(32, -1).double()
    steps = torch.log2(top / v.cpu().double()) * 254 / moment_codes.LOG_OCTAVES
    apart = here[0].cpu() != cpu[0]
    assert (((steps % 1) - 0.5).abs()[apart] < 1e-5).all()
    return f"equal but {int(apart.sum())} of {v.numel()} at a midpoint"


@check("8-bit moments compiled: parameters a few ulp from eager's, codes alike (3 steps)")
def _coded_compiled(device: torch.device) -> str:
    """The graph (`containers.update.compiled`) against the eager 8-bit step, each step from
    the same state (the suite's tolerance, `test_compiled_adam._close`): codes may differ only
    where a moment lies within a few ulp of the midpoint between two codes."""
    runs = []
    torch.manual_seed(0)
    shapes = [(1024, 4096), (96, 64), (33, 70)]
    start = [torch.randn(s, device=device) for s in shapes]
    grads = [[torch.randn(s, device=device) for s in shapes] for _ in range(3)]
    for compiled in (False, True):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        runs.append((params, LeanAdamW(params, **KW, moment_dtype="8bit", compiled=compiled)))
    (ref, eager), (ours, graph) = runs
    differ = total = loose = numel = 0
    for step in range(3):
        for p, q, g in zip(ref, ours, grads[step]):
            p.grad, q.grad = g, g.clone()
        eager.step()
        graph.step()
        for p, q in zip(ref, ours):
            diff, size = (p - q).detach().abs(), p.detach().abs()
            assert bool((diff <= 2e-6 * size + 1e-5).all()), (step, float(diff.max()))
            loose += int((diff > 1e-6 * size + 1e-7).sum())
            numel += p.numel()
            for name in ("exp_avg", "exp_avg_sq"):
                a, b = eager.state[p][name], graph.state[q][name]
                differ += int((a["code"] != b["code"]).sum())
                total += a["code"].numel()
                for k in a:
                    a[k].copy_(b[k])
            with torch.no_grad():
                p.copy_(q)
    assert loose <= numel // 10_000 and differ <= total // 1000, (loose, differ, total)
    return f"{loose} of {numel} parameters beyond 1e-6 relative; {differ} of {total} codes differ"


@check("torch's fused AdamW kernel takes bf16 moments beside fp32 parameters unwidened")
def _kernel_takes_bf16(device: torch.device) -> str:
    p = torch.randn(4096, device=device)
    g = torch.randn_like(p)
    m, v = (torch.zeros_like(p, dtype=torch.bfloat16) for _ in range(2))
    step = torch.zeros((), device=device)
    try:
        torch._fused_adamw_(
            [p], [g], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999,
            weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False,
        )  # fmt: skip
    except RuntimeError as e:
        return "no: " + str(e).splitlines()[0][:100]
    return "yes (a direct path could skip the widening)"


@check("remainders + bf16 moments keep the fp32 masters bitwise (mixed precision, 3 steps)")
def _remainders_exact(device: torch.device) -> str:
    runs = {}
    for keep in (False, True):
        parts = _parts(device, 2, 64, torch.bfloat16)
        settings = MixedPrecision(store_param_remainders=keep)
        opt = MixedPrecisionOptimizersContainer(
            parts, LeanAdamW, {**KW, "moment_dtype": "bfloat16"}, settings=settings
        )
        for step in range(3):
            _give(parts, _grads(parts, step))
            opt.step()
        sd = opt.state_dict()
        runs[keep] = (_params(parts), {k: v for k, v in sd.items() if k.startswith("master")})
    assert _equal(runs[False][0], runs[True][0]), "bf16 parameters differ"
    masters = runs[False][1]
    assert masters and all(torch.equal(masters[k], runs[True][1][k]) for k in masters)
    return f"{len(masters)} masters equal"


@check("offload to pinned CPU is readable at once; the reloaded step is bitwise")
def _offload(device: torch.device) -> str:
    runs = []
    for offload in (False, True):
        parts = _parts(device, 2, 1024, torch.bfloat16)
        opt = MixedPrecisionOptimizersContainer(parts, torch.optim.AdamW, KW)
        _give(parts, _grads(parts, 0))
        opt.step()
        if offload:
            before = {k: v.clone() for k, v in opt.state_dict().items() if torch.is_tensor(v)}
            opt.offload()
            # No synchronize here: a reader on the host right after offload must see the values.
            after = opt.state_dict()
            moved = [k for k in before if after[k].device.type == "cpu" and before[k].dim()]
            bad = [k for k in moved if not torch.equal(after[k], before[k].cpu())]
            assert not bad, f"read before the copy landed: {bad[:3]}"
            opt.reload()
        _give(parts, _grads(parts, 1))
        opt.step()
        runs.append(_params(parts))
    assert _equal(*runs), "the step after reload differs"
    return f"{len(moved)} tensors moved, all equal"


def _timed(device: torch.device, fn: Callable[[], None], steps: int) -> float:
    """Seconds per call of `fn`, `steps` calls, CUDA events on CUDA."""
    if device.type == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(steps):
            fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3 / steps
    import time

    t = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t) / steps


def _interleaved(
    device: torch.device, runs: dict[str, Callable[[], None]], repeats: int, steps: int
) -> dict[str, list[float]]:
    for fn in runs.values():
        fn()  # state made, kernels loaded
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(repeats):
        for name in list(runs) if r % 2 == 0 else list(reversed(runs)):
            times[name].append(_timed(device, runs[name], steps))
    return times


def check_table(device: torch.device, layouts: list[tuple[int, int]], repeats: int) -> str:
    """Issue 28's table on this device: the default step, check on and off, over one fused
    AdamW over all parameters."""
    rows = []
    for n, width in layouts:
        base = _parts(device, n, width)
        contenders = {
            "fused": lambda ps: torch.optim.AdamW([p for m in ps for p in m.parameters()], **KW),
            "check on": lambda ps: OptimizersContainer(ps, torch.optim.AdamW, KW),
            "check off": lambda ps: OptimizersContainer(
                ps, torch.optim.AdamW, KW, skip_nonfinite=False
            ),
        }
        runs = {}
        for name, build in contenders.items():
            parts = copy.deepcopy(base)
            _give(parts, _grads(parts, 0))  # never cleared: every step does the same work
            runs[name] = build(parts).step
        # The flag alone, and the step with the read-only inf-norm as the flag instead of
        # torch's AMP check (a read and a write, one output): side by side.
        _give(base, _grads(base, 0))
        grads = [p.grad for m in base for p in m.parameters()]
        contenders["flag alone"] = contenders["flag alone, inf-norm"] = None
        runs["flag alone"] = lambda g=grads: nonfinite_flag(g, [])
        runs["flag alone, inf-norm"] = lambda g=grads: _norm_flag(g, [])
        # The norm a clip takes, its squares summed in fp32 (today's; may overflow for finite
        # values, so not finite is confirmed by a second pass and the host) or in fp64 (finite
        # iff every element is: the norm would be an exact device flag, no host decision).
        contenders["norm alone, fp32"] = contenders["norm alone, fp64 squares"] = None
        runs["norm alone, fp32"] = lambda g=grads: torch._foreach_norm(g)
        runs["norm alone, fp64 squares"] = lambda g=grads: torch._foreach_norm(
            g, 2, dtype=torch.float64
        )
        parts = copy.deepcopy(base)
        _give(parts, _grads(parts, 0))
        step = OptimizersContainer(parts, torch.optim.AdamW, KW).step
        contenders["check on, inf-norm flag"] = None
        runs["check on, inf-norm flag"] = lambda step=step: _with_flag(_norm_flag, step)
        # Each tensor's smallest and largest element, read once (a reduction kernel each,
        # NaN kept, exact: no square to overflow).
        contenders["flag alone, aminmax"] = contenders["check on, aminmax flag"] = None
        runs["flag alone, aminmax"] = lambda g=grads: _aminmax_flag(g, [])
        parts = copy.deepcopy(base)
        _give(parts, _grads(parts, 0))
        step = OptimizersContainer(parts, torch.optim.AdamW, KW).step
        runs["check on, aminmax flag"] = lambda step=step: _with_flag(_aminmax_flag, step)
        if device.type == "cuda":  # (on a CPU: a compile for nothing, the host decides there)
            candidates = [("compiled", _compiled_flag), ("fp64-norm", _fp64_norm_flag)]
            try:
                _triton_flag(grads, [])
                candidates.append(("triton table", _triton_flag))
            except Exception as e:  # a candidate: its failure must not cost the table
                print(f"triton flag: not timed: {type(e).__name__}: {e}", flush=True)
            for name, flag in candidates:
                contenders[f"flag alone, {name}"] = contenders[f"check on, {name} flag"] = None
                runs[f"flag alone, {name}"] = lambda g=grads, flag=flag: flag(g, [])
                parts = copy.deepcopy(base)
                _give(parts, _grads(parts, 0))
                step = OptimizersContainer(parts, torch.optim.AdamW, KW).step
                runs[f"check on, {name} flag"] = lambda step=step, flag=flag: _with_flag(flag, step)
        times = _interleaved(device, runs, repeats, 5)
        numel = sum(p.numel() for m in base for p in m.parameters())
        t0 = statistics.median(times["fused"])
        for name in contenders:
            ratios = sorted(a / b for a, b in zip(times[name], times["fused"]))
            q1, med, q3 = (ratios[int(f * (len(ratios) - 1))] for f in (0.25, 0.5, 0.75))
            t = statistics.median(times[name])
            goal = "<= 1.15" if name == "check on" else ""
            gbps = 28 * numel / t0 / 1e9 if name == "fused" else None
            rows.append(
                (
                    f"{n} parts x {numel / n / 1e6:.1f}M",
                    name,
                    f"{t * 1e3:.3f}" + (f" ({gbps:.0f} GB/s)" if gbps else ""),
                    f"{med:.3f} [{q1:.3f}, {q3:.3f}]",
                    goal,
                )
            )
        del runs, base
        torch.cuda.empty_cache() if device.type == "cuda" else None
    return markdown_table(rows, ("layout", "step", "ms", "/ fused (IQR)", "goal"))


def _norm_flag(tensors: list[torch.Tensor], groups: list) -> torch.Tensor:
    """The flag from each tensor's largest magnitude (NaN kept): read-only, one output each."""
    return (~torch.stack(torch._foreach_norm(tensors, float("inf"))).isfinite()).any().float()


def _aminmax_flag(tensors: list[torch.Tensor], groups: list) -> torch.Tensor:
    """The flag from each tensor's smallest and largest element (NaN kept): read-only and
    exact (finite iff every element is), two outputs a tensor."""
    if groups:
        raise ValueError(f"_aminmax_flag: one process only, got groups {groups}")
    extremes = [x for t in tensors if t.numel() for x in torch.aminmax(t)]
    if not extremes:
        return torch.zeros((), device=tensors[0].device if tensors else None)
    return (~torch.stack(extremes).isfinite().all()).float()


def _compiled_flag(tensors: list[torch.Tensor], groups: list) -> torch.Tensor:
    """The flag as one inductor graph: each tensor's largest magnitude (NaN kept), read once,
    no write; static shapes (inductor splits a reduction over many blocks only when it knows
    the size) and combo kernels (several tensors a launch). A candidate, timed here."""
    if groups:
        raise ValueError(f"_compiled_flag: one process only, got groups {groups}")
    return _flag_graph()(tensors)


def _fp64_norm_flag(tensors: list[torch.Tensor], groups: list) -> torch.Tensor:
    """The flag from the norm with fp64 squares (`sum_of_squares`, exact: one multi-tensor
    kernel, read only, finite iff every element is), as a clipped step takes it."""
    if groups:
        raise ValueError(f"_fp64_norm_flag: one process only, got groups {groups}")
    return (~sum_of_squares(tensors, tensors[0].device, exact=True).isfinite()).float()


def _triton_flag(tensors: list[torch.Tensor], groups: list) -> torch.Tensor:
    """The flag from a hand-written Triton kernel, one launch a dtype over a table of the
    tensors' addresses and sizes (a kernel a tensor was host-bound: ~110 us of Python launch
    each on an H100): program (b, t) reads block b of tensor t once, no write (`x - x == 0` is
    false only for inf and NaN), and stores the flag if it finds one; blocks past a tensor's
    end return at once. The table reaches the device from pinned memory, without a host sync.
    A candidate (issue 28's floor on a GPU is one read of the gradients), timed here."""
    if groups:
        raise ValueError(f"_triton_flag: one process only, got groups {groups}")
    device = tensors[0].device
    found = torch.zeros((), device=device)
    (kernel, types), block = _triton_kernel(), 8192
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t if t.is_contiguous() else t.contiguous())
    for dtype, ts in by_dtype.items():
        table = torch.tensor(
            [[t.data_ptr() for t in ts], [t.numel() for t in ts]],
            dtype=torch.int64,
            pin_memory=device.type == "cuda",
        ).to(device, non_blocking=True)
        blocks = max(-(-t.numel() // block) for t in ts)
        # (blocks on the grid's first axis: the others hold at most 65535)
        kernel[(blocks, len(ts))](table, len(ts), found, ELEMENT=types[dtype], BLOCK=block)
    return found


@functools.cache
def _triton_kernel():  # (triton imported here: the CPU wheel has none)
    import triton
    import triton.language as tl

    @triton.jit
    def flag(table_ptr, count, found_ptr, ELEMENT: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(1)
        n = tl.load(table_ptr + count + t)
        start = tl.program_id(0).to(tl.int64) * BLOCK
        if start < n:
            base = tl.load(table_ptr + t).to(tl.pointer_type(ELEMENT))
            offsets = start + tl.arange(0, BLOCK)
            x = tl.load(base + offsets, mask=offsets < n, other=0.0).to(tl.float32)
            bad = tl.max(tl.where(x - x == 0.0, 0, 1), axis=0)
            if bad > 0:
                tl.store(found_ptr, 1.0)

    types = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    return flag, types


@functools.cache
def _flag_graph() -> Callable[[list[torch.Tensor]], torch.Tensor]:
    def flag(tensors: list[torch.Tensor]) -> torch.Tensor:
        largest = torch.stack([t.abs().amax() for t in tensors]).amax()
        return (~largest.isfinite()).float()

    return torch.compile(flag, dynamic=False, fullgraph=True, options={"combo_kernels": True})


def _with_flag(flag: Callable, step: Callable[[], None]) -> None:
    import containers.container as module

    kept, module.nonfinite_flag = module.nonfinite_flag, flag
    try:
        step()
    finally:
        module.nonfinite_flag = kept


def _compiled(
    moment_dtype: str, remainders: bool = False, **container: Any
) -> Callable[[nn.Module], OptimizersContainer]:
    kwargs = {**KW, "moment_dtype": moment_dtype, "compiled": True}
    settings = MixedPrecision(store_param_remainders=remainders)
    return lambda m: MixedPrecisionOptimizersContainer(
        [m], LeanAdamW, kwargs, settings=settings, **container
    )


def _compiled_8bit(m: nn.Module) -> OptimizersContainer:
    return OptimizersContainer([m], LeanAdamW, {**KW, "moment_dtype": "8bit", "compiled": True})


FP32, MP = TODAY, MP_TODAY
COMPILED = {
    "AdamW, bf16 moments, compiled": (
        torch.float32,
        lambda m: OptimizersContainer(
            [m], LeanAdamW, {**KW, "moment_dtype": "bfloat16", "compiled": True}
        ),
        FP32, ("", ""),
    ),
    "AdamW, 8-bit moments, compiled": (torch.float32, _compiled_8bit, FP32, ("", "")),
    "mixed precision, fp32 masters + moments, compile": (
        torch.bfloat16, _compiled("float32"), MP, ("", "")
    ),
    "mixed precision, fp32 masters + bf16 moments, compile": (
        torch.bfloat16, _compiled("bfloat16"), MP, ("", "")
    ),
    "mixed precision, remainders + bf16 moments, compile": (
        torch.bfloat16, _compiled("bfloat16", remainders=True), MP, ("", "")
    ),
    # Not the container's default (`max_norm = 0.0` measures the norm, one host sync): without
    # a norm the skip is left to the graph, as the AdamW rows leave it to the fused kernel.
    "mixed precision, fp32 masters + moments, compile, max_norm=None (no norm)": (
        torch.bfloat16, _compiled("float32", max_norm=None), MP, ("", "")
    ),
}  # fmt: skip
LEAN = {name: CONTENDERS[name] for name in (FP32, "AdamW, bf16 moments", "AdamW, 8-bit moments",
        MP, "mixed precision, remainders + bf16 moments")}  # fmt: skip
"""`bench_lean_state.py`'s rows that a GPU times."""
ISSUE_25 = {MP: " <= 2.00", "mixed precision, fp32 masters + moments, compile": " <= 1.20"}
"""Issue 25's goals against one fp32 fused AdamW: eager mixed precision, compiled."""


def lean_table(device: torch.device, width: int, layers: int, repeats: int) -> str:
    """`bench_lean_state.py`'s step table on this device, and mixed precision's compiled
    step (`implementation = "compiled"`) with fp32 and bf16 moments."""
    # (compiled rows on a GPU only: on a CPU inductor's first compile takes longer than the
    # smoke run, and its figures are another question, bench_mixed_precision.py's)
    contenders = {**LEAN, **(COMPILED if device.type == "cuda" else {})}
    runs = {}
    for name, (dtype, build, *_) in contenders.items():
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))).to(device, dtype)
        runs[name] = (model, build(model))
    first = runs[FP32][0]
    numel = sum(p.numel() for p in first.parameters())
    torch.manual_seed(1)
    grads = [torch.randn(p.shape, device=device) * 1e-2 for p in first.parameters()]
    # As backward leaves them: in the parameters' dtype (no step changes a gradient).
    given = {d: [g.to(d) for g in grads] for d in (torch.float32, torch.bfloat16)}

    def stepper(model: nn.Module, opt: OptimizersContainer, name: str) -> Callable[[], None]:
        def step() -> None:
            for p, g in zip(model.parameters(), given[next(model.parameters()).dtype]):
                p.grad = g
            opt.step()

        return step

    steps = {n: stepper(*r, name=n) for n, r in runs.items()}
    times = _interleaved(device, steps, repeats, 5)
    rows = []
    for name, (_, _, baseline, goals, *_) in contenders.items():
        param_bytes, kept = steady_bytes(*runs[name])
        t, t0 = statistics.median(times[name]), statistics.median(times[baseline or name])
        rows.append(
            (
                name,
                f"{kept / numel:.2f} {goals[0]}".rstrip(),
                f"{(param_bytes + kept) / numel:.2f} {goals[1]}".rstrip(),
                f"{t * 1e3:.3f} ({t / t0:.2f}x)"
                + (" <= 1.00x" if baseline and "bf16 moments" in name else ""),
                f"{t / statistics.median(times[FP32]):.2f}{ISSUE_25.get(name, '')}",
            )
        )
    head = (
        f"{numel / 1e6:.1f}M parameters ({layers} x Linear({width})), gradients given in the "
        "parameters' dtype; ratios against the row's baseline (today's of its kind), and "
        "against fp32 AdamW (issue 25: compiled mixed precision <= 1.20, eager <= 2.00)"
    )
    columns = ("", "state B/param", "params + state B/param", "step ms", "/ fp32 AdamW")
    return f"{head}\n\n{markdown_table(rows, columns)}\n\n{_host_side(device, steps)}"


def _host_side(device: torch.device, steps: dict[str, Callable[[], None]]) -> str:
    """What the host spends and holds around the table's steps (why compiled rows ran ~0.85
    ms a step slower on an H100 after issue 28's table in the same process: benchmarks/
    README.md): each row's host time for 5 steps without waiting for the device, and what
    those steps asked of the device and pinned-memory allocators (cudaMalloc, cudaHostAlloc:
    each can wait for the device; the compiled steps pin their hyperparameters every step);
    then the compiled graphs' dynamo cache entries and the live Python objects."""
    import gc
    import time

    from containers.update import compiled

    cuda = device.type == "cuda"

    def allocations() -> tuple[int, int]:
        if not cuda:
            return 0, 0
        pinned = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
        return torch.cuda.memory_stats().get("num_device_alloc", 0), pinned

    lines = []
    for name, step in steps.items():
        times, before = [], allocations()
        for _ in range(3):  # the least of 3 runs of 5 steps
            torch.cuda.synchronize() if cuda else None
            start = time.perf_counter()
            for _ in range(5):
                step()
            times.append((time.perf_counter() - start) / 5 * 1e6)
        torch.cuda.synchronize() if cuda else None
        device_calls, pinned_calls = (b - a for a, b in zip(before, allocations()))
        lines.append(
            f"host us a step (no device wait, least of 3 x 5): {name} {min(times):.0f}; "
            f"cudaMalloc {device_calls}, cudaHostAlloc {pinned_calls} in those 15 steps"
        )
    fn = compiled._update_one
    entries = {
        fn.__name__: len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__))
    }
    lines.append(f"dynamo cache entries {entries}; live Python objects {len(gc.get_objects())}")
    return "\n".join(lines)


def profile(device: torch.device, width: int, layers: int) -> str:
    """Where a step's time goes (`--profile`): torch.profiler over 5 steps each of fp32 AdamW
    (today's), AdamW with bf16 moments compiled (`implementation = "compiled"`), and the same
    graph compiled with inductor's combo kernels (several tensors' updates a launch: an option
    measured here, not the library's choice), and AdamW with 8-bit moments compiled (whether
    inductor keeps the decoded moments in registers: one kernel a tensor), the top operations
    by their own time on the device (on the CPU without one), after each its step time alone."""
    import torch.profiler as tp

    import containers.update.compiled as module

    cuda = device.type == "cuda"
    activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if cuda else [])
    adam = module._update_one  # a new code object: dynamo keeps compiled code per code object
    combo = type(adam)(adam.__code__.replace(co_name="_adam_combo"), adam.__globals__)
    combo = torch.compile(
        combo, dynamic=True, fullgraph=True, options={"size_asserts": False, "combo_kernels": True}
    )
    lean = "AdamW, bf16 moments, compiled"
    coded = "AdamW, 8-bit moments, compiled"
    contenders = {
        FP32: (CONTENDERS[FP32][1], None),
        lean: (COMPILED[lean][1], None),
        f"{lean}, combo kernels": (COMPILED[lean][1], combo),
        coded: (COMPILED[coded][1], None),
    }
    out = []
    for name, (build, compiled) in contenders.items():
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))).to(device)
        opt = build(model)
        grads = [torch.randn_like(p) * 1e-2 for p in model.parameters()]

        def step(model: nn.Module = model, opt: OptimizersContainer = opt, grads=grads) -> None:
            for p, g in zip(model.parameters(), grads):
                p.grad = g
            opt.step()

        kept = module._graph
        module._graph = (lambda c=compiled: c) if compiled is not None else kept
        try:
            for _ in range(3):  # the state made, the graph compiled
                step()
            torch.cuda.synchronize() if cuda else None
            with tp.profile(activities=activities) as prof:
                for _ in range(5):
                    step()
                torch.cuda.synchronize() if cuda else None
            wall = statistics.median(_timed(device, step, 10) for _ in range(5))
        finally:
            module._graph = kept
        by = "self_device_time_total" if cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=by, row_limit=15, max_name_column_width=60)
        out.append(f"{name}: {wall * 1e3:.3f} ms a step (5 steps profiled)\n{table}")
    head = f"{layers} x Linear({width}), gradients in fp32, torch.profiler"
    return "\n\n".join([head, *out])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--profile", action="store_true", help="where a step's time goes, only")
    parser.add_argument(
        "--tables", default="check,lean", help="the timed tables after the checks: check, lean"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__}, {name}\n")
    if args.profile:
        print(profile(device, *((256, 2) if args.quick else (4096, 8))))
        return 0
    failed = 0
    for what, fn in CHECKS:
        try:
            detail = fn(device)
            print(f"PASS  {what}: {detail}", flush=True)
        except Exception as e:  # a check's failure is its line, not the end of the run
            failed += 1
            where = traceback.extract_tb(e.__traceback__)[-1]
            print(f"FAIL  {what}: {type(e).__name__}: {e} ({where.name}:{where.lineno})")
    print()
    if args.quick:
        layouts, width, layers, repeats = [(2, 64)], 256, 2, 2
    else:  # 8 x 12.9M and 32 x 3.2M parameters: ~103M each, ~2.9 GB of AdamW traffic a step
        layouts, width, layers, repeats = [(8, 1792), (32, 896)], 4096, 8, args.repeats
    tables = {
        "check": lambda: check_table(device, layouts, repeats),
        "lean": lambda: lean_table(device, width, layers, repeats),
    }
    for table in (tables[t] for t in args.tables.split(",") if t):
        try:
            print(table(), "\n", flush=True)
        except Exception:
            failed += 1
            traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
