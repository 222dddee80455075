"""The one-pass kernel (`cpu_adam`) over many tensors in one call: a flat group's update
(`update_spans`) and a sum of squares for the clip norm (`sum_of_squares`).

Torch's fused kernels and norms are one C++ call over a list of tensors, run by its OpenMP
threads. A ctypes call a tensor costs ~10 us of Python (checks, pointers, the call): 3 ms of a
6 ms step over a transformer's 291 tensors, and it ran on one thread. Here the tensors are cut
into `threads()` shares of about equal elements (at multiples of `CUT` elements inside a
tensor), handed over in one call, and the shares run on torch's own OpenMP threads: the kernel
links no runtime; it is given torch's `GOMP_parallel` (`team`), checked to run on torch's
threads (no new thread appears) before it is used. Python threads of our own (ctypes lets go
of the GIL) were slower: they shared the 2 cores with torch's OpenMP workers, which spin a
while after each of torch's parallel regions (a mixed-precision step 12.6 ms; 9.9 with the
spinning cut short by GOMP_SPINCOUNT; on torch's threads 7.6). Without that runtime (another
OpenMP, a failed check) each call runs on the calling thread.

A cut changes no update's bits (the kernel computes each element apart, all on its vector
arithmetic); it orders the sum of squares, so a norm depends on the thread count (and is the
same for the same count).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import operator
import os
from collections.abc import Sequence

import torch

from containers.optim import cpu_adam, cpu_checks

__all__ = ["CUT", "give_runtime", "shares", "sum_of_squares", "team", "threads", "update_spans"]

logger = logging.getLogger(__name__)

CUT = 64
"""Elements a cut inside a tensor is a multiple of: one cache line of fp32 (no two threads
write one line) and a multiple of the kernel's vector width."""

Share = tuple[tuple[int, int, int], ...]
"""A thread's spans: (tensor index, first element, end)."""

_P = ctypes.c_void_p
_teams: dict[tuple[int, int], bool] = {}  # (id(lib), threads) -> torch's runtime checked


def threads(lib: cpu_adam.Library) -> int:
    """How many threads share a call: torch's intra-op count where `team(lib)` (one thread
    needs no runtime), else 1."""
    n = max(1, torch.get_num_threads())
    return n if n == 1 or team(lib) else 1


def team(lib: cpu_adam.Library) -> bool:
    """Whether `lib` runs its shares on torch's OpenMP threads at torch's thread count
    (`give_runtime`, once a count: a probe of one thread would tell no runtime apart)."""
    key = (id(lib), max(1, torch.get_num_threads()))
    if key not in _teams:
        give_runtime(lib, ctypes.CDLL(None))
    return _teams[key]


def give_runtime(lib: cpu_adam.Library, where: ctypes.CDLL) -> bool:
    """Give `lib` the OpenMP runtime whose entry points `where` finds (the process's global
    ones: torch loads its runtime globally) if it is the one torch runs: every thread of a
    probe region of torch's thread count is a thread the process had before (torch's workers,
    started by a region of torch's first; a second runtime starts threads of its own). False
    (and `lib` on one thread) where there is none, it is another, or threads cannot be told
    apart (no /proc)."""
    n = max(1, torch.get_num_threads())
    lib.oc_use_runtime(None, None, None)
    _teams[id(lib), n] = False
    try:
        entry = [ctypes.cast(getattr(where, n), _P) for n in _RUNTIME]
    except AttributeError as e:
        logger.info("cpu_spans: no OpenMP runtime found (%s); the CPU kernel runs on one thread", e)
        return False
    torch.ones(1 << 22).sum()  # torch's workers started (a region above its grain size)
    before = _threads_now()
    lib.oc_use_runtime(*entry)
    tids = (ctypes.c_int64 * n)()
    lib.oc_team_probe(tids, n)
    team = {str(t) for t in tids}
    if before is None or len(team) != n or not team <= before:
        lib.oc_use_runtime(None, None, None)
        logger.warning(
            "cpu_spans: the OpenMP runtime found is not shown to be torch's (a probe of %d "
            "threads ran on %d new to the process); the CPU kernel runs on one thread",
            n, len(team - (before or set())),
        )  # fmt: skip
        return False
    _teams[id(lib), n] = True
    return True


def _threads_now() -> set[str] | None:
    """The ids of this process's threads, or None where they cannot be listed."""
    try:
        return set(os.listdir("/proc/self/task"))
    except OSError:
        return None


_RUNTIME = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")


@functools.lru_cache(maxsize=64)
def shares(numels: tuple[int, ...], parts: int) -> tuple[Share, ...]:
    """`numels`' elements cut into `parts` shares of about equal size (fewer where there are
    fewer than `parts` x `CUT` elements), each a run of whole tensors and pieces of tensors."""
    total = sum(numels)
    parts = max(1, min(parts, total // CUT))
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(parts)]
    share, given = 0, 0
    for i, n in enumerate(numels):
        lo = 0
        while lo < n:
            take = n - lo
            room = (share + 1) * total // parts - given  # what this share still takes
            if share < parts - 1 and take > room:
                take = min(n - lo, max(CUT, room - room % CUT))
            out[share].append((i, lo, lo + take))
            given += take
            lo += take
            if share < parts - 1 and given >= (share + 1) * total // parts:
                share += 1
    return tuple(tuple(s) for s in out if s)


def _table(lib: cpu_adam.Library, numels: tuple[int, ...]) -> tuple[Share, ctypes.Array, int]:
    """All shares' spans in order, where each share starts (`first`), and the thread count."""
    n = threads(lib)
    cut = shares(numels, n)
    first = (ctypes.c_int64 * (len(cut) + 1))()
    at = 0
    for s, share in enumerate(cut):
        first[s] = at
        at += len(share)
    first[len(cut)] = at
    return tuple(span for share in cut for span in share), first, n


def update_spans(
    lib: cpu_adam.Library,
    hyper: cpu_adam.Settings,
    *,
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    starts: Sequence[int],
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    master: torch.Tensor | None = None,
    remainder: torch.Tensor | None = None,
    adamw: bool,
    maximize: bool = False,
    found_inf: torch.Tensor | None = None,
) -> None:
    """`cpu_adam.update` of tensor i for every i: gradient `grads[i]`, bf16 parameter
    `params[i]`, and the flat buffers (`master`, or `remainder`, and both moments) from
    element `starts[i]`; one call over `threads()`. Nothing is written where `found_inf` is
    set.

    Raises:
        ValueError: a tensor the kernel would misread (device, dtype, layout, numel, a span
            past a buffer's end), before anything is written.
    """
    if master is not None and remainder is not None:
        raise ValueError("cpu_spans.update_spans: give master or remainder, not both")
    mode = cpu_checks.REMAINDER if remainder is not None else cpu_checks.MASTER_AND_PARAM
    kept = remainder if remainder is not None else master
    numels = tuple(p.numel() for p in params)
    _check_spans(grads, params, starts, numels, kept, mode, exp_avg, exp_avg_sq, found_inf, hyper)
    if not grads:
        return
    bf16 = grads[0].dtype == torch.bfloat16
    kinds = bf16 | (exp_avg.dtype == torch.bfloat16) << 1 | mode << 2
    flags = int(adamw) | int(maximize) << 1
    size = 2 if bf16 else 4
    table, first, n = _table(lib, numels)
    spans = (ctypes.c_int64 * (2 * len(table)))()
    spans[0::2] = [hi - lo for _, lo, hi in table]
    spans[1::2] = [starts[i] + lo for i, lo, _ in table]
    g = (_P * len(table))(*[grads[i].data_ptr() + size * lo for i, lo, _ in table])
    p = (_P * len(table))(*[params[i].data_ptr() + 2 * lo for i, lo, _ in table])
    master_at = kept.data_ptr() if master is not None else None  # type: ignore[union-attr]
    rem_at = kept.data_ptr() if remainder is not None else None  # type: ignore[union-attr]
    flag = found_inf.data_ptr() if found_inf is not None else None
    lib.oc_adam_spans(
        len(first) - 1, first, spans, g, p, master_at, rem_at, exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(), hyper, flags, kinds, flag, n,
    )  # fmt: skip


def sum_of_squares(lib: cpu_adam.Library, tensors: Sequence[torch.Tensor]) -> float:
    """The sum of squares of contiguous CPU fp32 or bf16 `tensors` (one dtype), each element
    read once; fp32 sums of 256 squares added in fp64 (a square beyond fp32's range makes it
    inf, as an fp32 norm's). One call over `threads()`.

    Raises:
        ValueError: a tensor the kernel would misread, before it is read.
    """
    if not tensors:
        return 0.0
    dtype = tensors[0].dtype
    for t in tensors:
        if t.dtype != dtype or dtype not in cpu_checks.FLOATS or not t.is_cpu:
            raise ValueError(
                f"cpu_spans.sum_of_squares: a {t.dtype} tensor on {t.device} beside "
                f"{dtype}; expected CPU tensors of one of {cpu_checks.FLOATS}"
            )
        if not t.is_contiguous():
            raise ValueError("cpu_spans.sum_of_squares: a tensor is not contiguous")
    size = tensors[0].element_size()
    table, first, n = _table(lib, tuple(t.numel() for t in tensors))
    spans = (ctypes.c_int64 * len(table))(*[hi - lo for _, lo, hi in table])
    ptrs = (_P * len(table))(*[tensors[i].data_ptr() + size * lo for i, lo, _ in table])
    out = (ctypes.c_double * (len(first) - 1))()
    lib.oc_sum_squares(len(out), first, spans, ptrs, int(dtype == torch.bfloat16), out, n)
    return sum(out)


def _check_spans(
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    starts: Sequence[int],
    numels: tuple[int, ...],
    kept: torch.Tensor | None,
    mode: int,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    found_inf: torch.Tensor | None,
    hyper: cpu_adam.Settings,
) -> None:
    """Raise ValueError unless `update_spans` may hand these to the kernel. (The checks a
    tensor run as C loops, `map` over the tensors, the message made on failure: Python a
    tensor is most of a step's overhead.)"""
    if not len(grads) == len(params) == len(starts):
        raise ValueError(
            f"cpu_spans.update_spans: {len(grads)} grads, {len(params)} params and "
            f"{len(starts)} starts; give one of each a tensor"
        )
    if kept is None:
        raise ValueError("cpu_spans.update_spans: give master or remainder (a flat buffer)")
    flat = {"master or remainder": kept, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    wanted = cpu_checks.wanted(mode)
    for (name, t), dtypes in zip(flat.items(), (wanted[0] or wanted[1], *wanted[4:])):
        if t.dtype not in dtypes or not t.is_cpu or not t.is_contiguous():
            raise ValueError(cpu_checks.misread(name, t, dtypes, t.numel(), _WHERE))
    if exp_avg.dtype != exp_avg_sq.dtype or exp_avg.numel() != exp_avg_sq.numel():
        raise ValueError("cpu_spans.update_spans: exp_avg and exp_avg_sq differ in dtype or size")
    end = min(kept.numel(), exp_avg.numel())
    if starts and (min(starts) < 0 or max(map(sum, zip(starts, numels))) > end):
        i = next(i for i, (s, n) in enumerate(zip(starts, numels)) if s < 0 or s + n > end)
        raise ValueError(
            f"cpu_spans.update_spans: tensor {i} ({numels[i]} elements from {starts[i]}) runs "
            f"past the flat buffers' {end} elements"
        )
    grad_dtype = grads[0].dtype if grads else torch.float32
    for name, ts, dtype, sizes in (
        ("grads", grads, grad_dtype, numels),
        ("params", params, torch.bfloat16, numels),
    ):
        if not (
            {t.dtype for t in ts} <= {dtype}
            and dtype in cpu_checks.FLOATS
            and all(map(_IS_CPU, ts))
            and all(map(torch.Tensor.is_contiguous, ts))
            and tuple(map(torch.Tensor.numel, ts)) == sizes
        ):
            i, t = next(
                (i, t)
                for i, (t, n) in enumerate(zip(ts, sizes))
                if t.dtype != dtype or not t.is_cpu or not t.is_contiguous() or t.numel() != n
                or dtype not in cpu_checks.FLOATS
            )  # fmt: skip
            raise ValueError(
                cpu_checks.misread(f"{name}[{i}]", t, (dtype,), sizes[i], _WHERE, "its parameter")
            )
    cpu_checks.check_flag_and_hyper(found_inf, hyper, _WHERE)


_IS_CPU = operator.attrgetter("is_cpu")
_WHERE = "cpu_spans.update_spans"
