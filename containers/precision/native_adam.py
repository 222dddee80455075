"""A native CPU kernel for the mixed-precision step of a flat Adam/AdamW group (`compile`).

The eager flat step (`containers.precision.flat_adam`) makes four passes over a group: cast the
low-precision gradients into fp32, multiply, torch's fused Adam, cast the masters back; the
norm makes a fifth. Every pass is bandwidth and a per-tensor dispatch, so the step costs about
twice the fp32 fused AdamW step that moves the same bytes. This kernel reads each
low-precision gradient once and writes the fp32 master, both moments and the low-precision
parameter in the same pass, over every tensor of the group in one call (a second call gives
the sum of squares for the norm). On a CPU `torch.compile` cannot make that one call: it
compiles per graph, and a graph over hundreds of tensors takes minutes to build.

`native_adam.c` is built on first use with the system C compiler (as inductor does) into a
cache keyed by the source, the compiler and the CPU; about a second, once per machine. Where
that fails the eager flat path runs, with a warning. The arithmetic is that of torch's CPU fused
kernel's vector path, so the result equals the eager flat path bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["BLOCK", "Kernel", "Plan", "addresses", "build", "load"]

logger = logging.getLogger(__name__)

BLOCK = 1 << 16
"""Elements per unit of work a thread takes (a tensor larger than this is split)."""

_SOURCE = Path(__file__).with_name("native_adam.c")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
_DTYPES = {torch.bfloat16: 0, torch.float16: 1}


class _Job(ctypes.Structure):
    _fields_ = [
        ("grads", ctypes.POINTER(ctypes.c_void_p)),
        ("params", ctypes.POINTER(ctypes.c_void_p)),
        ("offsets", ctypes.POINTER(ctypes.c_int64)),
        ("blocks", ctypes.POINTER(ctypes.c_int64)),
        ("num_blocks", ctypes.c_int64),
        ("master", ctypes.c_void_p),
        ("exp_avg", ctypes.c_void_p),
        ("exp_avg_sq", ctypes.c_void_p),
        ("fp16", ctypes.c_int),
        ("adamw", ctypes.c_int),
        ("decay", ctypes.c_int),
        ("maximize", ctypes.c_int),
        ("threads", ctypes.c_int),
        ("grads_fp32", ctypes.c_int),
        *((name, ctypes.c_float) for name in ("factor", "wd", "w1", "beta2", "w2")),
        *((name, ctypes.c_float) for name in ("bc2_sqrt", "eps", "neg_step")),
        ("sums", ctypes.c_double * 256),
    ]


def _blocks(sizes: Sequence[int]) -> ctypes.Array:
    """(tensor, first, end) of every unit of at most `BLOCK` elements, flattened."""
    flat: list[int] = []
    for i, n in enumerate(sizes):
        for lo in range(0, n, BLOCK):
            flat += (i, lo, min(n, lo + BLOCK))
    return (ctypes.c_int64 * len(flat))(*flat)


def addresses(tensors: Sequence[torch.Tensor | None], dtype: torch.dtype) -> ctypes.Array | None:
    """The tensors' addresses (None: an empty tensor's, 0) if the kernel can read every one of
    them (contiguous, on the CPU, `dtype`: bf16, fp16, or fp32 for gradient sums); None if
    not. One pass: this runs on hundreds of tensors every step."""
    if dtype not in _DTYPES and dtype != torch.float32:
        return None
    out = []
    for t in tensors:
        if t is None:
            out.append(0)
        elif t.dtype is dtype and t.is_cpu and t.is_contiguous():
            out.append(t.data_ptr())
        else:
            return None
    return (ctypes.c_void_p * len(out))(*out)


class Kernel:
    """The loaded kernel."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._adam, self._square_sum = lib.oc_adam, lib.oc_square_sum
        self._adam.argtypes = self._square_sum.argtypes = [ctypes.POINTER(_Job)]
        self._adam.restype, self._square_sum.restype = ctypes.c_int, ctypes.c_double
        self._blocks: dict[tuple[int, ...], ctypes.Array] = {}

    def square_sum(self, tensors: Sequence[torch.Tensor]) -> float | None:
        """The sum of the squares of every element of `tensors` (one dtype), in fp64; None
        if the kernel cannot read them (see `addresses`)."""
        if not tensors:
            return 0.0
        if tensors[0].dtype not in _DTYPES:
            return None
        grads = addresses(tensors, tensors[0].dtype)
        if grads is None:
            return None
        sizes = tuple(t.numel() for t in tensors)
        if sizes not in self._blocks:  # the same gradients every step: walked once
            if len(self._blocks) >= 64:  # (callers whose lists change: kept bounded)
                self._blocks.clear()
            self._blocks[sizes] = _blocks(sizes)
        blocks = self._blocks[sizes]
        job = _Job(
            grads=grads, blocks=blocks, num_blocks=len(blocks) // 3,
            fp16=_DTYPES[tensors[0].dtype], threads=torch.get_num_threads(),
        )  # fmt: skip
        return self._square_sum(ctypes.byref(job))

    def adam(
        self,
        plan: Plan,
        grads: Sequence[torch.Tensor | None],
        buffers: dict[str, torch.Tensor],
        hyper: dict[str, float | bool],
        factor: float,
    ) -> bool:
        """One step over every tensor of `plan`'s flat group: the gradients (None: an empty
        tensor's; in the parameters' dtype, or fp32 sums) times `factor`, Adam or AdamW with
        `hyper` at step count `hyper["step"]`; masters, moments and parameters updated. False
        (nothing done) if the kernel cannot read the gradients."""
        first = next((g for g in grads if g is not None), None)
        fp32 = first is not None and first.dtype == torch.float32
        held = addresses(grads, torch.float32 if fp32 else plan.dtype)  # alive until the call
        if held is None or plan.params is None:
            return False
        beta1, beta2, step, lr = hyper["beta1"], hyper["beta2"], hyper["step"], hyper["lr"]
        wd, adamw = hyper["weight_decay"], hyper["adamw"]
        job = _Job(
            grads=held, params=plan.params, offsets=plan.offsets,
            blocks=plan.blocks, num_blocks=plan.num_blocks,
            master=buffers["master"].data_ptr(), exp_avg=buffers["exp_avg"].data_ptr(),
            exp_avg_sq=buffers["exp_avg_sq"].data_ptr(), fp16=_DTYPES[plan.dtype], grads_fp32=fp32,
            adamw=bool(adamw), decay=wd != 0, maximize=bool(hyper["maximize"]),
            threads=torch.get_num_threads(), factor=factor, wd=1 - lr * wd if adamw else wd,
            w1=1 - beta1, beta2=beta2, w2=1 - beta2, bc2_sqrt=math.sqrt(1 - beta2**step),
            eps=hyper["eps"], neg_step=-(lr / (1 - beta1**step)),
        )  # fmt: skip
        self._adam(ctypes.byref(job))
        return True


class Plan:
    """How the kernel walks a flat group (made when the group is, or its parameters move).

    Args:
        params: the group's low-precision parameters (this rank's pieces), in order.
        starts: where each starts in the group's flat fp32 buffers.
    """

    def __init__(self, params: Sequence[torch.Tensor], starts: Sequence[int]) -> None:
        self.dtype = params[0].dtype
        # None: the kernel cannot write them
        self.params = addresses(params, self.dtype) if self.dtype in _DTYPES else None
        self.at = [p.data_ptr() for p in params] if self.params is not None else None
        self.offsets = (ctypes.c_int64 * len(params))(*starts[: len(params)])
        self.blocks = _blocks([p.numel() for p in params])
        self.num_blocks = len(self.blocks) // 3


def _cache_dir() -> Path:
    root = os.environ.get("OPTIMIZER_CONTAINERS_CACHE") or os.environ.get("XDG_CACHE_HOME")
    return Path(root or Path.home() / ".cache") / "optimizer-containers"


def _cpu() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((ln for ln in text.splitlines() if ln.startswith("flags")), text[:4096])


def _torch_uses_libgomp() -> bool:
    """Whether the process's OpenMP runtime is GNU's (torch's Linux wheels): then the kernel
    links the same libgomp and shares torch's thread team. Another runtime (Intel's, LLVM's)
    in the process would make a second team compete with torch's: then no OpenMP."""
    try:
        return "libgomp" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


@functools.cache
def load() -> Kernel | None:
    """The kernel, built on first use; None (with a warning) where it cannot be built."""
    return build(openmp=_torch_uses_libgomp())


def build(openmp: bool) -> Kernel | None:
    """Build (or find in the cache) and load the kernel, with OpenMP or single-threaded."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.warning("compile: no C compiler found (set CC); flat groups step eagerly")
        return None
    flags = [*_FLAGS, *(["-fopenmp"] if openmp else [])]
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60)
        key = hashlib.sha256(
            "\0".join([_SOURCE.read_text(), cc, version.stdout, " ".join(flags), _cpu()]).encode()
        ).hexdigest()[:16]
        target = _cache_dir() / f"native_adam-{key}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                cmd = [cc, *flags, str(_SOURCE), "-o", str(built), "-lm"]
                subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
                os.replace(built, target)  # atomic: ranks building at once all see a whole file
        return Kernel(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or err
        logger.warning("compile: the native Adam kernel did not build (%s); eager", detail)
        return None
