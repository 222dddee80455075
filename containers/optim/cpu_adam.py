"""Adam/AdamW on a CPU in one pass over lean or mixed-precision storage (`cpu_adam.c`).

Torch's CPU kernels step fp32 parameters only beside fp32 moments, so lean state on a CPU went
through fp32 scratch: widen the bf16 moments, run `torch._fused_adamw_`, round them back (and
for mixed precision: cast the gradients in, join the remainders, split them, copy the masters
out), a pass of memory traffic each. That made a step with half the state 1.3-2x slower than
today's fp32 one (benchmarks/README.md). `cpu_adam.c` reads and writes each element's storage
once, in its own dtype, and computes exactly what the vector loop of torch's fused kernel
computes on the widened values, so every container's result stays bitwise what it was, at
0.80-0.94x (AdamW, bf16 moments) and 0.84-0.87x (mixed precision, remainders) today's fp32
step at one thread. 8-bit moments (`containers.optim.coded_adam`) it decodes, steps and codes
again a span of blocks at a time (`update_coded`), the codes decided by the same fp32
thresholds as `moment_codes`: 18x faster than torch ops through scratch (750 -> 42 ms,
16.8M parameters, one thread), still 3x today's fp32 step (table lookups and gathers).

What keeps a runtime-built kernel safe here (each point tested):
- Built lazily, only when a CPU step asks for it (a GPU job never builds or loads it), plain
  C99 that links no OpenMP runtime (a flat group's call, `cpu_spans`, runs on torch's own
  OpenMP threads, handed to it and checked to be torch's first), used where torch steps on
  few threads (`kernel()`), for this CPU (`-march=native`), into a private cache
  (`containers.optim.c_library`: the compiler, the cache's owner and mode, concurrent builds,
  a bad cached file).
- Before use, its argument layout number (`oc_adam_abi`) must be this module's, and a
  self-check steps random values through it and through torch's fused kernel (8-bit: decoded,
  stepped by torch's kernel, coded by `moment_codes`): it is used only if they agree bit for
  bit (a torch built with other contractions falls back, never drifts).
- Every call checks what the C code trusts: devices, dtypes, contiguity and that every tensor
  has the gradient's numel, raising ValueError before anything is written.
- Any failure to build or load (no compiler, a failed build, a foreign cache, a failed check):
  one warning line, and torch's path as before. `OPTIMIZER_CONTAINERS_CPU_ADAM=0`, or
  `disabled()`, chooses torch's path (benchmarks time both side by side).

Torch's fused kernel runs each tensor's last `numel % 16` elements through a scalar loop whose
roundings depend on how torch was compiled; callers step those through torch (`body_numel`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from containers.optim.c_library import open_library
from containers.optim.cpu_checks import (
    HYPER,
    MASTER,
    MASTER_AND_PARAM,
    REMAINDER,
    check,
    check_flag_and_hyper,
    misread,
    readable_flag,
)
from containers.optim.moment_codes import (
    BLOCK,
    decode_log,
    decode_signed,
    encode_log,
    encode_signed,
    log_tables,
    scale_shape,
)

__all__ = [
    "MAX_THREADS",
    "Library",
    "Settings",
    "body_numel",
    "disabled",
    "kernel",
    "library",
    "load",
    "readable_flag",
    "settings",
    "update",
    "update_coded",
]

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ("-std=c99", "-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno")
ABI = 3
"""The argument layout `update`, `update_coded` and `cpu_spans` pass; the library's
`oc_adam_abi()` must return it."""
VECTOR = 16
"""Elements of torch's fused kernel's vector loop: it steps the rest of a tensor apart."""

MAX_THREADS = 2
"""The most torch threads at which the kernel steps: measured on a 2-core machine only, where
it beats torch's kernels at 1 and 2 threads (benchmarks/README.md: a flat group's one call,
`cpu_spans`, on torch's threads; lean state's tensor a call, on one thread, still beats
torch's widening through scratch at 2). Beyond 2 threads, not measured: torch's kernels,
which scale with the threads."""

Settings = ctypes.Array
"""A group's hyperparameters packed for the kernel (`settings`)."""
Library = ctypes.CDLL
"""The built kernel (`kernel()`)."""

_state: dict[str, Library | None] = {}  # "lib": the checked library, or None
_off = [os.environ.get("OPTIMIZER_CONTAINERS_CPU_ADAM", "1") == "0"]


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within: `kernel()` is None, so every caller takes torch's path."""
    before, _off[0] = _off[0], True
    try:
        yield
    finally:
        _off[0] = before


def kernel() -> Library | None:
    """The kernel where it is the faster path, else None (torch's path): `library()` while
    torch steps on up to `MAX_THREADS` CPU threads (the trainer's ranks: OMP_NUM_THREADS=1)."""
    return library() if torch.get_num_threads() <= MAX_THREADS else None


def library() -> Library | None:
    """The built and self-checked kernel (built at the first call), or None (not usable
    here, or `disabled`)."""
    if _off[0]:
        return None
    if "lib" not in _state:
        _state["lib"] = load(SOURCE)
    return _state["lib"]  # type: ignore[return-value]


def body_numel(n: int) -> int:
    """Of `n` elements, how many torch's fused kernel steps in its vector loop."""
    return n - n % VECTOR


def settings(
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    step: float,
    factor: float = 1.0,
) -> Settings:
    """Hyperparameters for `update`, as torch's fused kernel takes them (`step` the count
    after this step's increment; `factor` multiplies each gradient first)."""
    values = (float(lr), beta1, beta2, weight_decay, eps, float(step), factor)
    return (ctypes.c_double * HYPER)(*values)


def update(
    lib: Library,
    hyper: Settings,
    *,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    master: torch.Tensor | None = None,
    param: torch.Tensor | None = None,
    remainder: torch.Tensor | None = None,
    adamw: bool,
    maximize: bool = False,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One update of contiguous CPU tensors of one numel: `master` (fp32) in place, and
    `param` (bf16) set to it rounded; or with `remainder` (int16), the master held as `param`
    and `remainder` (`containers.precision.remainders`). Gradients fp32 or bf16, moments
    fp32 or bf16. Nothing is written where `found_inf` (one fp32 value on the CPU) is set.

    Raises:
        ValueError: a tensor the kernel would misread (device, dtype, layout, numel), before
            anything is written.
    """
    mode = REMAINDER if remainder is not None else MASTER if param is None else MASTER_AND_PARAM
    tensors = (master, remainder, param, grad, exp_avg, exp_avg_sq)
    check(tensors, mode, found_inf, hyper)
    kinds = (grad.dtype == torch.bfloat16) | (exp_avg.dtype == torch.bfloat16) << 1 | mode << 2
    flags = int(adamw) | int(maximize) << 1
    flag = found_inf.data_ptr() if found_inf is not None else None

    ptrs = [t.data_ptr() if t is not None else None for t in tensors]
    lib.oc_adam(grad.numel(), *ptrs, hyper, flags, kinds, flag)


def update_coded(
    lib: Library,
    hyper: Settings,
    *,
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: tuple[torch.Tensor, torch.Tensor],
    exp_avg_sq: tuple[torch.Tensor, torch.Tensor],
    adamw: bool,
    maximize: bool = False,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One update of fp32 `master` rows (in place, its last dimension the row) with fp32
    gradients, whose moments are 8-bit codes (`containers.optim.moment_codes`): each a
    (code, scale) pair, rewritten in place. Nothing is written where `found_inf` is set.

    Raises:
        ValueError: a tensor the kernel would misread, before anything is written.
    """
    cols = master.shape[-1] if master.dim() else 1
    rows = master.numel() // cols if cols else 0
    blocks = rows * -(-cols // BLOCK)
    wanted = [
        ("master", master, torch.float32, master.numel()),
        ("grad", grad, torch.float32, master.numel()),
        ("exp_avg code", exp_avg[0], torch.int8, master.numel()),
        ("exp_avg scale", exp_avg[1], torch.float32, blocks),
        ("exp_avg_sq code", exp_avg_sq[0], torch.uint8, master.numel()),
        ("exp_avg_sq scale", exp_avg_sq[1], torch.float32, blocks),
    ]
    for name, t, dtype, n in wanted:
        if t.numel() != n:
            each = f"one a block of {BLOCK} in each row" if "scale" in name else "the master's"
            raise ValueError(
                f"cpu_adam.update_coded: {name} has {t.numel()} elements, expected {n} ({each})"
            )
        if t.dtype != dtype or not t.is_cpu or not t.is_contiguous():
            raise ValueError(misread(name, t, (dtype,), n))
    check_flag_and_hyper(found_inf, hyper, "cpu_adam.update_coded")
    if not rows:
        return
    values, thresholds = log_tables(torch.device("cpu"))
    flags = int(adamw) | int(maximize) << 1
    flag = found_inf.data_ptr() if found_inf is not None else None
    ptrs = [t.data_ptr() for _, t, _, _ in wanted]
    tables = values.data_ptr(), thresholds.data_ptr()
    lib.oc_adam_coded(rows, cols, *ptrs, hyper, flags, *tables, flag)


def load(source: Path) -> Library | None:
    """`source` built (or taken from the cache), loaded and checked; None, with one warning
    line saying why, if any of that fails."""
    try:
        lib = open_library(source, FLAGS, _bind)
    except Exception as e:  # every failure to build or load is a fallback, never a crash
        logger.warning("cpu_adam: not used (%s); CPU lean steps take torch's slower path", e)
        return None
    bad = _self_check(lib)
    if bad:
        logger.warning(
            "cpu_adam: disagrees with this torch's fused Adam/AdamW kernel (%s); CPU lean "
            "steps take torch's slower path",
            bad,
        )
        return None
    return lib


def _bind(lib: Library) -> None:
    """Type `lib`'s functions; raise RuntimeError if its argument layout is not `ABI`."""
    lib.oc_adam_abi.restype = ctypes.c_int
    if lib.oc_adam_abi() != ABI:
        # (not a broken file: building the same source again would not change it)
        raise RuntimeError(
            f"{lib._name} has argument layout {lib.oc_adam_abi()}, this module's {ABI}"
        )
    fn = lib.oc_adam
    fn.restype = ctypes.c_int
    pointer = ctypes.c_void_p
    fn.argtypes = [ctypes.c_int64, *[pointer] * 7, ctypes.c_int, ctypes.c_int, pointer]
    coded = lib.oc_adam_coded
    coded.restype = ctypes.c_int
    coded.argtypes = [ctypes.c_int64, ctypes.c_int64, *[pointer] * 7, ctypes.c_int, *[pointer] * 3]
    spans = lib.oc_adam_spans
    spans.restype = ctypes.c_int
    spans.argtypes = [ctypes.c_int64, *[pointer] * 9, ctypes.c_int, ctypes.c_int, pointer]
    spans.argtypes += [ctypes.c_int]  # threads
    squares = lib.oc_sum_squares
    squares.restype = None
    squares.argtypes = [ctypes.c_int64, *[pointer] * 3, ctypes.c_int, pointer, ctypes.c_int]
    lib.oc_use_runtime.restype = None
    lib.oc_use_runtime.argtypes = [pointer] * 3
    lib.oc_team_probe.restype = None
    lib.oc_team_probe.argtypes = [pointer, ctypes.c_int]


def _self_check(lib: Library) -> str:
    """'' if the kernel steps random values exactly as torch's fused kernel does on their
    fp32 widening (AdamW and Adam with L2, minimized or not, bf16 moments and gradients),
    else what differed."""
    gen = torch.Generator().manual_seed(0)
    n = 64 * VECTOR
    for adamw in (True, False):
        for maximize in (False, True):
            p = torch.randn(n, generator=gen)
            g = torch.randn(n, generator=gen).bfloat16()
            m = (torch.randn(n, generator=gen) * 0.1).bfloat16()
            v = (torch.rand(n, generator=gen) * 0.1).bfloat16()
            hyper = dict(lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8)
            wide = [p.clone(), m.float(), v.float()]
            fused = torch._fused_adamw_ if adamw else torch._fused_adam_
            fused(
                [wide[0]], [g.float() * 0.5], [wide[1]], [wide[2]], [], [torch.tensor(3.0)],
                amsgrad=False, maximize=maximize, **hyper,
            )  # fmt: skip
            h = settings(step=3.0, factor=0.5, **hyper)
            update(
                lib, h, grad=g, exp_avg=m, exp_avg_sq=v, master=p, adamw=adamw, maximize=maximize
            )
            for name, ours, theirs in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), wide):
                if not torch.equal(ours, theirs.to(ours.dtype)):
                    return f"{name} (adamw={adamw}, maximize={maximize})"
    return _self_check_coded(lib, gen)


def _self_check_coded(lib: Library, gen: torch.Generator) -> str:
    """'' if `update_coded` gives what decoding, torch's fused kernel and encoding give (rows
    of 80: whole blocks and a shorter one), else what differed."""
    shape = (8, 5 * VECTOR)
    hyper = dict(lr=0.01, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8)
    for adamw in (True, False):
        p, g = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        m = torch.randn(shape, generator=gen) * 0.1
        v = torch.rand(shape, generator=gen) * torch.exp2(-30 * torch.rand(shape, generator=gen))
        codes = []
        for values, dtype, encode in ((m, torch.int8, encode_signed), (v, torch.uint8, encode_log)):
            pair = (torch.empty(shape, dtype=dtype), torch.empty(scale_shape(shape)))
            encode(values, *pair)
            codes.append(pair)
        wide = [torch.empty(shape) for _ in range(2)]
        decode_signed(*codes[0], wide[0])
        decode_log(*codes[1], wide[1])
        ours = [p.clone(), *(tuple(t.clone() for t in pair) for pair in codes)]
        fused = torch._fused_adamw_ if adamw else torch._fused_adam_
        fused([p], [g], wide[:1], wide[1:], [], [torch.tensor(3.0)], amsgrad=False,
              maximize=False, **hyper)  # fmt: skip
        encode_signed(wide[0], *codes[0])
        encode_log(wide[1], *codes[1])
        h = settings(step=3.0, **hyper)
        update_coded(lib, h, master=ours[0], grad=g, exp_avg=ours[1], exp_avg_sq=ours[2],
                     adamw=adamw)  # fmt: skip
        theirs = [p, *codes]
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), ours, theirs):
            pairs = zip(a, b) if isinstance(a, tuple) else [(a, b)]
            if not all(torch.equal(x, y) for x, y in pairs):
                return f"8-bit {name} (adamw={adamw})"
    return ""
