"""Moment codecs: how one Adam moment of a parameter is stored between steps, decoded into
fp32 scratch for torch's fused kernel and encoded back.

A codec works on *pieces*: `(stored, lo, hi)`, elements [lo, hi) of one parameter's stored
moment, cut by the driver at multiples of `row(stored)` (blocks never straddle a cut). A
stored form already in the dtype the kernel steps is used as it is (`direct`: no copy), so an
fp32 plan is torch's fused step bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["BF16_FUSED_DEVICES", "Dense", "MomentCodec", "Piece"]

# Whose fused Adam/AdamW takes bf16 moments beside fp32 values (elsewhere: fp32 scratch).
BF16_FUSED_DEVICES = frozenset({"cuda"})

Piece = tuple[Any, int, int]
"""A stored moment (local) and the run of its elements [lo, hi) that a piece covers."""


class MomentCodec:
    """One moment's stored form; subclasses say how it is made, decoded and encoded."""

    name = ""
    bytes_per_value = 4.0  # steady bytes a value takes, block scales included

    def new(self, moment: str, p: torch.Tensor) -> Any:
        """A zero moment named `moment` for parameter `p` (a DTensor's placed as `p`)."""
        raise NotImplementedError

    def row(self, stored: Any) -> int:
        """Elements of `stored` (local) that a cut keeps together (1: anywhere)."""
        return 1

    def direct(self, stored: Any, dtype: torch.dtype) -> bool:
        """Whether the kernel steps `stored` (local) as it is beside values of `dtype`."""
        return False

    def decode(self, moment: str, pieces: Sequence[Piece], outs: Sequence[torch.Tensor]) -> None:
        """Write the fp32 values of `pieces` into `outs` (flat, one per piece)."""
        raise NotImplementedError

    def encode(self, moment: str, outs: Sequence[torch.Tensor], pieces: Sequence[Piece]) -> None:
        """Store the fp32 values `outs` into `pieces`."""
        raise NotImplementedError

    # Inside a compiled graph: a whole tensor, flat (a dict's entries flat too).

    def graphs(self, stored: Any) -> bool:
        """Whether the compiled driver takes `stored` (local) in a graph."""
        return False

    def constants(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Tensors the graph functions read (tables), made outside the graph."""
        return ()

    def values(self, moment: str, stored: Any, consts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The fp32 values of `stored` (traced into the graph)."""
        raise NotImplementedError

    def store(
        self,
        moment: str,
        stored: Any,
        new: torch.Tensor,
        skip: torch.Tensor,
        consts: Sequence[torch.Tensor],
    ) -> None:
        """Store fp32 `new` into `stored` unless `skip` (traced into the graph)."""
        raise NotImplementedError


class Dense(MomentCodec):
    """A tensor of `dtype` shaped as the parameter: decoding widens exactly, encoding rounds
    to nearest even (exact for values the dtype holds, so a skipped step changes nothing)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = str(dtype).removeprefix("torch.")
        self.bytes_per_value = float(dtype.itemsize)

    def new(self, moment: str, p: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(p, dtype=self.dtype)

    def direct(self, stored: Any, dtype: torch.dtype) -> bool:
        # torch's CUDA kernel takes bf16 moments beside fp32 values as they are
        fused_bf16 = stored.device.type in BF16_FUSED_DEVICES and dtype == torch.float32
        return stored.dtype == dtype or (fused_bf16 and stored.dtype == torch.bfloat16)

    def decode(self, moment: str, pieces: Sequence[Piece], outs: Sequence[torch.Tensor]) -> None:
        torch._foreach_copy_(list(outs), [s.view(-1)[lo:hi] for s, lo, hi in pieces])

    def encode(self, moment: str, outs: Sequence[torch.Tensor], pieces: Sequence[Piece]) -> None:
        torch._foreach_copy_([s.view(-1)[lo:hi] for s, lo, hi in pieces], list(outs))

    def graphs(self, stored: Any) -> bool:
        return stored.is_contiguous()

    def values(self, moment: str, stored: Any, consts: Sequence[torch.Tensor]) -> torch.Tensor:
        return stored.float()

    def store(self, moment, stored, new, skip, consts) -> None:  # type: ignore[no-untyped-def]
        stored.copy_(torch.where(skip, stored.float(), new))
