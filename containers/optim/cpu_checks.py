"""What the one-pass kernel (`cpu_adam.c`) trusts, checked before a call: its argument
layout's constants, and the devices, dtypes, contiguity and sizes of the tensors it is
handed. A failed check raises ValueError before anything is written, its message made only on
failure (a few microseconds a call otherwise)."""

from __future__ import annotations

import ctypes

import torch

__all__ = [
    "FLOATS",
    "HYPER",
    "MASTER",
    "MASTER_AND_PARAM",
    "REMAINDER",
    "check",
    "check_flag_and_hyper",
    "misread",
    "readable_flag",
    "wanted",
]

MASTER, MASTER_AND_PARAM, REMAINDER = 0, 1, 2
"""What the kernel keeps of each master: fp32, fp32 and its bf16 copy, or a bf16 parameter
and a 16-bit remainder."""
HYPER = 7
"""Doubles in a group's settings: lr, beta1, beta2, weight_decay, eps, step, factor."""

_NAMES = ("master", "remainder", "param", "grad", "exp_avg", "exp_avg_sq")
FLOATS = (torch.float32, torch.bfloat16)
_WANTED = {  # mode -> the dtypes each of _NAMES may have (None: not given)
    MASTER: ((torch.float32,), None, None, FLOATS, FLOATS, FLOATS),
    MASTER_AND_PARAM: ((torch.float32,), None, (torch.bfloat16,), FLOATS, FLOATS, FLOATS),
    REMAINDER: (None, (torch.int16,), (torch.bfloat16,), FLOATS, FLOATS, FLOATS),
}


def wanted(mode: int) -> tuple[tuple[torch.dtype, ...] | None, ...]:
    """The dtypes `mode` takes for master, remainder, param, grad, exp_avg, exp_avg_sq."""
    return _WANTED[mode]


def check(
    tensors: tuple[torch.Tensor | None, ...],
    mode: int,
    found_inf: torch.Tensor | None,
    hyper: ctypes.Array,
) -> None:
    """Raise ValueError unless every tensor is what `oc_adam` will read and write (a few
    microseconds a call: the checks are the cheap ones, the message is made on failure)."""
    n = tensors[3].numel()  # type: ignore[union-attr]
    for name, t, dtypes in zip(_NAMES, tensors, _WANTED[mode]):
        if t is None or dtypes is None:
            if t is not dtypes:  # one given, the other not
                raise ValueError(
                    "cpu_adam.update: give master (and param, to set it to the master "
                    f"rounded), or param and remainder; {name} is "
                    f"{'missing' if t is None else 'extra'}"
                )
        elif t.dtype not in dtypes or not t.is_cpu or not t.is_contiguous() or t.numel() != n:
            raise ValueError(misread(name, t, dtypes, n))
    if tensors[5].dtype != tensors[4].dtype:  # type: ignore[union-attr]
        raise ValueError(
            f"cpu_adam.update: exp_avg_sq is a {tensors[5].dtype} tensor and exp_avg a "  # type: ignore[union-attr]
            f"{tensors[4].dtype} one; both moments have one dtype"  # type: ignore[union-attr]
        )
    check_flag_and_hyper(found_inf, hyper)


def check_flag_and_hyper(
    found_inf: torch.Tensor | None, hyper: ctypes.Array, where: str = "cpu_adam.update"
) -> None:
    """Raise ValueError (its message starting with `where`, the caller) unless the kernel can
    read `found_inf` and `hyper`."""
    if not readable_flag(found_inf):
        raise ValueError(
            f"{where}: found_inf is {found_inf.dtype} x {found_inf.numel()} on "
            f"{found_inf.device}; expected one float32 value on the CPU"
        )
    if not isinstance(hyper, ctypes.Array) or len(hyper) != HYPER:
        raise ValueError(f"{where}: hyper is {hyper!r}; make it with settings()")


def readable_flag(found_inf: torch.Tensor | None) -> bool:
    """Whether `update` can read `found_inf`: none, or one fp32 value in host memory."""
    return found_inf is None or (
        found_inf.dtype == torch.float32 and found_inf.is_cpu and found_inf.numel() == 1
    )


def misread(
    name: str,
    t: torch.Tensor,
    dtypes: tuple[torch.dtype, ...],
    n: int,
    where: str = "cpu_adam.update",
    against: str = "grad",
) -> str:
    """What is wrong with `name` (`t`) for the kernel: not `n` elements (those of `against`),
    or not a contiguous CPU tensor of `dtypes`."""
    if t.numel() != n:
        return (
            f"{where}: {name} has {t.numel()} elements and {against} {n}; every tensor of "
            "one update has the same number"
        )
    return (
        f"{where}: {name} is a {t.dtype} tensor on {t.device} (contiguous: "
        f"{t.is_contiguous()}); expected a contiguous CPU tensor of "
        f"{' or '.join(map(str, dtypes))}"
    )
