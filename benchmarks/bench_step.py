"""Optimizer step benchmark: container overhead, "auto" kernel choice, and memory bandwidth.

Usage::

    .venv/bin/python benchmarks/bench_step.py [--params N] [--parts K] [--repeats R]
                                              [--steps S] [--quick]

Every contender steps its own copy of the same model with identical gradients; contenders are
timed interleaved (order reversed on odd repeats, to cancel drift) and medians are reported.
See benchmarks/README.md for what each row and column means.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from components.optimizer import build_optimizers, resolve_optimizer
from config import Optimizer as OptimizerConfig
from containers import OptimizersContainer
from containers.parts import Precision

BYTES_PER_PARAM = 28
"""fp32 AdamW traffic per param per step: read param, grad, exp_avg, exp_avg_sq; write three."""

NONE = "—"


@dataclasses.dataclass(frozen=True)
class Settings:
    """Sizes and repeat counts of one benchmark run."""

    params: int
    parts: int
    repeats: int
    steps: int
    warmup: int
    copy_mb: int
    copy_trials: int
    tiny_steps: int
    """Section 6: steps per sample (a tiny step takes tens of microseconds)."""
    threads: int | None = None
    """torch's intra-op threads while timing; None: torch's default. On a shared machine the
    OpenMP workers of a step wait on each other when another process holds a core."""


DEFAULT = Settings(
    params=8_000_000,
    parts=8,
    repeats=15,
    steps=5,
    warmup=2,
    copy_mb=256,
    copy_trials=10,
    tiny_steps=100,
)
QUICK = Settings(
    params=20_000,
    parts=2,
    repeats=2,
    steps=5,
    warmup=3,
    copy_mb=4,
    copy_trials=3,
    tiny_steps=5,
    threads=1,
)


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the results table."""

    name: str
    ms: float | None = None
    ratio: float | None = None
    goal: float | None = None
    notes: str = ""

    def cells(self) -> list[str]:
        """The row's table cells: name, ms/step, ratio, goal, status, notes."""
        if self.goal is None or self.ratio is None:
            status = NONE
        else:
            status = "PASS" if self.ratio <= self.goal else "MISS"
        return [
            self.name,
            NONE if self.ms is None else f"{self.ms:.2f}",
            NONE if self.ratio is None else f"{self.ratio:.3f}",
            NONE if self.goal is None else f"<= {self.goal:.2f}",
            status,
            self.notes,
        ]


# -- model ------------------------------------------------------------------------------------


def part_width(params: int, parts: int) -> int:
    """Width `w` (multiple of 32) whose part of 4w^2 + 5w params best fits `params / parts`."""
    per_part = params / parts
    w = (-5 + math.sqrt(25 + 16 * per_part)) / 8
    return max(32, round(w / 32) * 32)


class Block(nn.Module):
    """A transformer-MLP-like block: Linear(w, 2w), Linear(2w, w) with biases, LayerNorm(w)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, 2 * width)
        self.w2 = nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width)


def make_part(width: int, index: int) -> nn.Module:
    """Part `index` of the model: one `Block` at FQN prefix `layers.<index>.` (unique FQNs)."""
    return nn.ModuleDict({"layers": nn.ModuleDict({str(index): Block(width)})})


def make_model(width: int, parts: int, seed: int = 0) -> list[nn.Module]:
    """Model parts with fixed, seeded parameters and gradients."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = [make_part(width, i) for i in range(parts)]
    for part in model:
        for p in part.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    return model


def clone_model(model: Sequence[nn.Module]) -> list[nn.Module]:
    """Independent copies of `model`'s parts, gradients included."""
    clones = [copy.deepcopy(part) for part in model]
    for src, dst in zip(model, clones):
        for p, q in zip(src.parameters(), dst.parameters()):
            q.grad = None if p.grad is None else p.grad.clone()
    return clones


def count_params(model: Sequence[nn.Module]) -> int:
    """Number of parameter elements in `model`."""
    return sum(p.numel() for part in model for p in part.parameters())


def all_params(model: Sequence[nn.Module]) -> list[nn.Parameter]:
    """Every parameter of `model`, in part order."""
    return [p for part in model for p in part.parameters()]


class PerOptimizerSteps(Precision):
    """The default precision as it was before the grouped step
    (`containers.update.driver.step_together`): each inner optimizer's own `step()`, one
    kernel call per part (the "before" of sections 5 and 6)."""

    @property
    def features(self) -> dict[str, str]:
        return {"host_skip": "PerOptimizerSteps (its apply reads no flag)"}

    @torch.no_grad()
    def apply(self, optimizers: Sequence[torch.optim.Optimizer], *_: Any) -> None:
        for opt in optimizers:
            opt.step()


# -- timing -----------------------------------------------------------------------------------


def median_ms(samples: Sequence[float]) -> float:
    """Median of `samples` (seconds), in milliseconds."""
    return statistics.median(samples) * 1e3


def time_interleaved(
    contenders: dict[str, Callable[[], Any]], repeats: int, steps: int, warmup: int
) -> dict[str, list[float]]:
    """Seconds per step of each contender, one sample of `steps` steps per repeat.

    Contenders run back to back in each repeat, in reverse order on odd repeats. All run the
    same number of steps per sample, so each pays the same share of cold-cache first steps.
    """
    for step in contenders.values():
        for _ in range(warmup):
            step()
    names = list(contenders)
    samples: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    gc_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(repeats):
            for name in names if r % 2 == 0 else reversed(names):
                step = contenders[name]
                start = time.perf_counter()
                for _ in range(steps):
                    step()
                samples[name].append((time.perf_counter() - start) / steps)
    finally:
        if gc_enabled:
            gc.enable()
    return samples


def describe_spread(values: Sequence[float]) -> str:
    """The interquartile range of `values`, or "" if there are too few."""
    if len(values) < 2:
        return ""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return f"IQR {q1:.3f}–{q3:.3f}"


def copy_bandwidth(nbytes: int, trials: int) -> tuple[float, float]:
    """Best `dst.copy_(src)` time (s) of an fp32 tensor of `nbytes`, and bytes/s read+written."""
    src = torch.rand(max(1, nbytes // 4))
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    best = math.inf
    for _ in range(trials):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best, 2 * src.numel() * src.element_size() / best


# -- benchmark --------------------------------------------------------------------------------


def ratio_row(name: str, a: Sequence[float], b: Sequence[float], goal: float | None = None) -> Row:
    """Row for the time ratio a/b: a's median ms, the median per-repeat ratio, its spread.

    Each repeat times a and b back to back, so per-repeat ratios cancel drift that a ratio of
    medians would keep.
    """
    ratios = [x / y for x, y in zip(a, b)]
    return Row(name, median_ms(a), statistics.median(ratios), goal, describe_spread(ratios))


def load_average() -> float | None:
    """The 1-minute load average, where the OS reports one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


SPLITS = (1, 4)
"""Section 5: the same parameter count in `--parts` times this many model parts (8, 32)."""

TINY_WIDTH = 32
"""Section 6: part width of the tiny parts (4,256 params each), where only fixed costs show."""


def run_splits(settings: Settings, kw: dict[str, Any], cfg: OptimizerConfig) -> list[Row]:
    """Section 5: "auto" (one fused call across parts) and the per-optimizer steps it
    replaced, each over one fused AdamW of all parameters, at each part count of `SPLITS`;
    and a second such AdamW over the first, which shows the noise floor of these ratios."""
    rows = []
    for parts in (settings.parts * k for k in SPLITS):
        model = make_model(part_width(settings.params, parts), parts)
        auto = build_optimizers(clone_model(model), cfg)
        auto.skip_nonfinite = False
        before = build_optimizers(clone_model(model), cfg, precision=PerOptimizerSteps())
        before.skip_nonfinite = False
        fused = torch.optim.AdamW(all_params(clone_model(model)), **kw, fused=True)
        control = torch.optim.AdamW(all_params(clone_model(model)), **kw, fused=True)
        t = time_interleaved(
            {
                "auto": auto.step,
                "before": before.step,
                "fused": fused.step,
                "control": control.step,
            },
            settings.repeats,
            settings.steps,
            settings.warmup,
        )
        size = f"{parts} parts x {count_params(model) // parts:,}"
        rows += [
            ratio_row(f'5 {size}: "auto" / one fused AdamW', t["auto"], t["fused"], 1.03),
            ratio_row(
                f"5 {size}: per-optimizer steps (before) / one fused AdamW", t["before"], t["fused"]
            ),
            ratio_row(
                f"5 {size}: noise: a 2nd one fused AdamW / the 1st", t["control"], t["fused"]
            ),
        ]
        del model, auto, before, fused, control
        gc.collect()
    return rows


def run_fixed_cost(settings: Settings, kw: dict[str, Any]) -> list[Row]:
    """Section 6: what the container adds per step over the bare per-part optimizers, on
    parts so small that the kernels cost next to nothing (microseconds per step)."""
    parts = settings.parts
    model = make_model(TINY_WIDTH, parts)
    opts = {**kw, "fused": True}
    container = OptimizersContainer(
        clone_model(model), torch.optim.AdamW, opts, skip_nonfinite=False
    )
    before = OptimizersContainer(
        clone_model(model),
        torch.optim.AdamW,
        opts,
        skip_nonfinite=False,
        precision=PerOptimizerSteps(),
    )
    bare = [torch.optim.AdamW(part.parameters(), **opts) for part in clone_model(model)]

    def step_bare() -> None:
        for opt in bare:
            opt.step()

    t = time_interleaved(
        {"container": container.step, "before": before.step, "bare": step_bare},
        2 * settings.repeats,
        settings.tiny_steps,
        settings.warmup,
    )

    def extra_row(name: str, a: Sequence[float], goal: float | None) -> Row:
        extra = [(x - y) * 1e6 for x, y in zip(a, t["bare"])]
        return Row(name, median_ms(a), statistics.median(extra), goal, describe_spread(extra))

    size = f"{parts} parts x {count_params(model) // parts:,}"
    return [
        Row(f"6 {size}: bare per-part fused AdamW loop", median_ms(t["bare"]), notes="baseline"),
        extra_row(f"6 {size}: container - bare loop (us, not a ratio)", t["container"], 20.0),
        extra_row(f"6 {size}: per-optimizer steps (before) - bare (us)", t["before"], None),
    ]


def torchtitan_container(model: list[nn.Module], kw: dict[str, Any]) -> Any:
    """torchtitan 0.3.0's OptimizersContainer over `model` (one catch-all AdamW group, fused),
    or None where torchtitan is not installed (its step is the per-part loop of section 1)."""
    try:
        from torchtitan.components.optimizer import OptimizersContainer as Titan
        from torchtitan.components.optimizer import ParamGroupConfig
    except Exception:  # not installed, or its own dependencies are missing
        return None
    group = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs=kw)
    return Titan.Config(param_groups=[group], implementation="fused").build(model_parts=model)


def run(settings: Settings) -> tuple[list[str], list[Row]]:
    """Run every measurement; return the header lines and the table rows."""
    load_before = load_average()
    width = part_width(settings.params, settings.parts)
    model = make_model(width, settings.parts)
    n = count_params(model)
    cfg = OptimizerConfig()
    kw = resolve_optimizer(cfg)[1]  # the hyperparameters build_optimizers uses

    def make(**options: Any) -> OptimizersContainer:
        return OptimizersContainer(
            clone_model(model), torch.optim.AdamW, {**kw, "fused": True}, **options
        )

    container = make()  # skips non-finite steps: one finite-check pass, one host sync
    unchecked = make(skip_nonfinite=False)
    clipped = make(max_norm=1.0)  # the trainer's default: the norm is measured anyway
    clipped_unchecked = make(max_norm=1.0, skip_nonfinite=False)
    per_part = [
        torch.optim.AdamW(part.parameters(), **kw, fused=True) for part in clone_model(model)
    ]
    auto = build_optimizers(clone_model(model), cfg)
    auto.skip_nonfinite = False  # section 2 compares kernels; section 1 prices the check
    fused = torch.optim.AdamW(all_params(clone_model(model)), **kw, fused=True)
    foreach = torch.optim.AdamW(all_params(clone_model(model)), **kw, foreach=True)
    for_loop = torch.optim.AdamW(all_params(clone_model(model)), **kw, foreach=False)

    # The same parameters as 1, 2 or 4 model parts on a rank (pipeline stages per rank):
    # what each inner optimizer more costs.
    groupings = [k for k in (1, 2, 4) if settings.parts % k == 0]
    by_parts = {}
    for k in groupings:
        subparts, size = clone_model(model), settings.parts // k
        grouped = [nn.ModuleList(subparts[i : i + size]) for i in range(0, settings.parts, size)]
        by_parts[f"parts_{k}"] = OptimizersContainer(
            grouped, torch.optim.AdamW, {**kw, "fused": True}
        ).step

    def step_per_part() -> None:
        for opt in per_part:
            opt.step()

    titan = torchtitan_container(clone_model(model), kw)
    checked = [p.grad for p in container._params]

    def read_once() -> None:  # what any separate check costs at least: one read, no write
        torch.stack([g.sum() for g in checked]).sum().item()

    t = time_interleaved(
        {
            "container": container.step,
            "unchecked": unchecked.step,
            "clipped": clipped.step,
            "clipped_unchecked": clipped_unchecked.step,
            "per_part": step_per_part,
            "auto": auto.step,
            "fused": fused.step,
            "foreach": foreach.step,
            "for_loop": for_loop.step,
            **by_parts,
            **({"torchtitan": titan.step} if titan is not None else {}),
            "read_once": read_once,
        },
        settings.repeats,
        settings.steps,
        settings.warmup,
    )
    copy_s, copy_bw = copy_bandwidth(settings.copy_mb * 2**20, settings.copy_trials)
    fused_s = median_ms(t["fused"]) / 1e3
    adam_bw = BYTES_PER_PARAM * n / fused_s
    auto_flags = {k: v for k, v in auto.param_groups[0].items() if k in ("fused", "foreach")}

    header = [
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 on cpu",
        f"model: {settings.parts} parts x (Linear({width}, {2 * width}) + "
        f"Linear({2 * width}, {width}) + LayerNorm({width})) = {n:,} params",
        f'build_optimizers(implementation="auto") resolved to {auto_flags}',
        f"timing: {settings.repeats} repeats, interleaved (order reversed on odd repeats), "
        f"{settings.steps} steps per sample after {settings.warmup} warm-up steps",
        "ms/step = median over repeats; ratio = median of per-repeat ratios (IQR in notes)",
    ]
    load_after = load_average()
    if load_before is not None and load_after is not None:
        header.append(
            f"1-min load average {load_before:.2f} before, {load_after:.2f} after, on "
            f"{os.cpu_count()} CPUs (load from other processes adds noise)"
        )
    rows = [
        ratio_row(
            "0 container, check on (default) / one fused AdamW", t["container"], t["fused"], 1.15
        ),
        ratio_row("0 container, check off / one fused AdamW", t["unchecked"], t["fused"]),
        ratio_row(
            "0 (one fused AdamW + one read of the gradients) / one fused AdamW",
            [a + b for a, b in zip(t["fused"], t["read_once"])],
            t["fused"],
        ),
        ratio_row(
            "0 per-part fused loop (torchtitan's step) / one fused AdamW", t["per_part"], t["fused"]
        ),
    ]
    if "torchtitan" in t:
        rows.append(
            ratio_row("0 torchtitan's container / one fused AdamW", t["torchtitan"], t["fused"])
        )
    rows += [
        Row(
            "1 per-part fused AdamW loop (baseline)",
            median_ms(t["per_part"]),
            notes=f"{settings.parts} x AdamW(fused=True)",
        ),
        ratio_row(
            "1 container, skip_nonfinite=False / per-part loop",
            t["unchecked"],
            t["per_part"],
            1.05,
        ),
        ratio_row(
            "1 container (finite check: 1 pass + 1 sync) / per-part loop",
            t["container"],
            t["per_part"],
        ),
        ratio_row(
            "1 max_norm=1: finite check / none (norm measured anyway)",
            t["clipped"],
            t["clipped_unchecked"],
            1.05,
        ),
        Row("2 AdamW(fused=True), one optimizer", median_ms(t["fused"]), notes="baseline"),
        Row("2 AdamW(foreach=True), one optimizer", median_ms(t["foreach"]), notes="baseline"),
        Row(
            "2 AdamW(foreach=False) for-loop, one optimizer",
            median_ms(t["for_loop"]),
            notes="baseline",
        ),
        ratio_row(
            '2 build_optimizers "auto" / per-part fused loop', t["auto"], t["per_part"], 1.10
        ),
        ratio_row('2 build_optimizers "auto" / one fused AdamW', t["auto"], t["fused"], 1.10),
        ratio_row('2 build_optimizers "auto" / foreach', t["auto"], t["foreach"]),
        ratio_row('2 build_optimizers "auto" / for-loop', t["auto"], t["for_loop"]),
        ratio_row("2 fused speedup over foreach (foreach / fused)", t["foreach"], t["fused"]),
        Row(
            f"3 copy bandwidth, dst.copy_(src) {settings.copy_mb} MB fp32",
            copy_s * 1e3,
            notes=f"{copy_bw / 1e9:.2f} GB/s read+write, best of {settings.copy_trials}",
        ),
        Row(
            "3 fused AdamW bandwidth / copy bandwidth",
            median_ms(t["fused"]),
            adam_bw / copy_bw,
            notes=f"{n / fused_s / 1e6:.1f} Mparam/s, {adam_bw / 1e9:.2f} GB/s "
            f"at {BYTES_PER_PARAM} B/param",
        ),
    ]
    rows += [
        ratio_row(
            f"4 container, {k} parts per rank / 1 part (same params)",
            t[f"parts_{k}"],
            t["parts_1"],
            1.10,
        )
        for k in groupings[1:]
    ]
    rows += run_splits(settings, kw, cfg)
    rows += run_fixed_cost(settings, kw)
    return header, rows


def format_table(rows: Sequence[Row]) -> str:
    """Rows as an aligned, pipe-separated table; numeric columns right-aligned."""
    head = ["benchmark", "ms/step", "ratio", "goal", "status", "notes"]
    cells = [row.cells() for row in rows]
    widths = [max(len(r[i]) for r in [head, *cells]) for i in range(len(head))]
    right = {1, 2}

    def line(values: Sequence[str]) -> str:
        padded = (
            v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths))
        )
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), rule, *(line(c) for c in cells)])


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    """Settings from the command line; `--quick` changes the defaults, explicit flags win."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--params", type=int, metavar="N", help=f"target param count ({DEFAULT.params:,})"
    )
    parser.add_argument("--parts", type=int, metavar="K", help=f"model parts ({DEFAULT.parts})")
    parser.add_argument(
        "--repeats", type=int, metavar="R", help=f"interleaved repeats ({DEFAULT.repeats})"
    )
    parser.add_argument(
        "--steps",
        type=int,
        metavar="S",
        help=f"steps per sample, fastest contender ({DEFAULT.steps})",
    )
    parser.add_argument(
        "--threads", type=int, metavar="T", help="torch threads (torch's default; --quick: 1)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 repeats (smoke run)")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else DEFAULT
    settings = dataclasses.replace(
        base,
        **{
            k: v
            for k in ("params", "parts", "repeats", "steps", "threads")
            if (v := getattr(args, k)) is not None
        },
    )
    if min(settings.params, settings.parts, settings.repeats, settings.steps) < 1:
        parser.error("--params, --parts, --repeats and --steps must be positive")
    if settings.threads is not None and settings.threads < 1:
        parser.error(f"--threads {settings.threads}: must be positive")
    return settings


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print its header and table."""
    start = time.perf_counter()
    settings = parse_args(argv)
    threads = torch.get_num_threads()
    try:
        if settings.threads is not None:
            torch.set_num_threads(settings.threads)
        header, rows = run(settings)
    finally:
        torch.set_num_threads(threads)  # the caller's (a test process runs on)
    print("\n".join(header))
    print()
    print(format_table(rows))
    print(f"\ntotal {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
