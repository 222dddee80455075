"""Master codecs: what torch's fused kernel steps for a parameter, and how the model's
parameter follows.

- `ParamItself`: the parameter (no precision of its own), stepped in place;
- `Fp32Masters`: an fp32 master stepped in place, the bf16/fp16 parameter rounded from it;
- `Remainders`: the fp32 master kept as the bf16 parameter plus an int16 remainder. bf16 is
  the upper half of fp32: rounding a master by adding half a bf16 ulp to its bits and keeping
  the upper half (round half away from zero; torch's `.to` rounds ties to even) leaves a lower
  half that, as a signed int16, restores the master exactly: bits = (param << 16) + remainder.

Pieces are `(value, low, lo, hi)`: the stepped tensor (the parameter, the master, or the
remainder), the model's low-precision parameter (None without one), elements [lo, hi).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["HALF_ULP", "Fp32Masters", "MasterCodec", "Remainders", "join", "split"]

HALF_ULP = 0x8000  # half a bf16 ulp in the low bits of an fp32's bit pattern

MasterPiece = tuple[torch.Tensor, Any, int, int]


def join(bits: torch.Tensor, remainder: torch.Tensor) -> None:
    """Turn `bits` (int32: sign-extended bf16 bits) into fp32 master bits with `remainder`."""
    torch.add(remainder, bits, alpha=1 << 16, out=bits)  # one pass


def split(bits: torch.Tensor, high: torch.Tensor) -> None:
    """Split fp32 master `bits` (int32) into rounded bf16 bits `high` and remainders `bits`."""
    torch.add(bits, HALF_ULP, out=high).bitwise_right_shift_(16)
    bits.sub_(high, alpha=1 << 16)


def _flat(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return t.view(-1)[lo:hi]


class MasterCodec:
    """The plain case: the kernel steps `value` in place and nothing follows it."""

    name = "param"
    decoded = False  # the kernel steps fp32 scratch decoded from the pieces

    def decode(self, pieces: Sequence[MasterPiece], outs: Sequence[torch.Tensor]) -> None:
        """fp32 values of `pieces` into `outs` (only where `decoded`)."""
        raise NotImplementedError

    def encode(
        self,
        outs: Sequence[torch.Tensor],
        pieces: Sequence[MasterPiece],
        spare: Sequence[torch.Tensor],
    ) -> None:
        """Store the stepped fp32 `outs` into `pieces` (`spare`: fp32 scratch as large,
        free to use)."""
        raise NotImplementedError

    def written(self, pieces: Sequence[MasterPiece]) -> None:
        """After the kernel stepped `value` in place: make the model's parameters follow."""

    # Inside a compiled graph: whole tensors, flat.

    def values(self, value: torch.Tensor, low: torch.Tensor | None) -> torch.Tensor:
        """The fp32 values the update starts from."""
        return value.float()

    def store(
        self,
        value: torch.Tensor,
        low: torch.Tensor | None,
        new: torch.Tensor,
        old: torch.Tensor,
        skip: torch.Tensor,
    ) -> None:
        """Store the updated fp32 `new` (`old` where `skip`)."""
        value.copy_(torch.where(skip, old, new))


class Fp32Masters(MasterCodec):
    """fp32 masters stepped in place; each model parameter takes its master's rounding."""

    name = "fp32"

    def written(self, pieces: Sequence[MasterPiece]) -> None:
        torch._foreach_copy_(
            [_flat(low, lo, hi) for _, low, lo, hi in pieces],
            [_flat(v, lo, hi) for v, _, lo, hi in pieces],
        )

    def store(self, value, low, new, old, skip) -> None:  # type: ignore[no-untyped-def]
        value.copy_(torch.where(skip, old, new))
        low.copy_(torch.where(skip, low, new.to(low.dtype)))


class Remainders(MasterCodec):
    """Masters as bf16 parameters plus int16 remainders (`value`), joined into scratch."""

    name = "remainders"
    decoded = True

    def decode(self, pieces: Sequence[MasterPiece], outs: Sequence[torch.Tensor]) -> None:
        bits = [out.view(torch.int32) for out in outs]
        high = [_flat(low, lo, hi).view(torch.int16) for _, low, lo, hi in pieces]
        torch._foreach_copy_(bits, high)  # sign-extended
        for b, (rem, _, lo, hi) in zip(bits, pieces):
            join(b, _flat(rem, lo, hi))

    def encode(
        self,
        outs: Sequence[torch.Tensor],
        pieces: Sequence[MasterPiece],
        spare: Sequence[torch.Tensor],
    ) -> None:
        highs = [s.view(torch.int32) for s in spare]
        for out, high in zip(outs, highs):
            split(out.view(torch.int32), high)
        torch._foreach_copy_(
            [_flat(low, lo, hi).view(torch.int16) for _, low, lo, hi in pieces], highs
        )
        torch._foreach_copy_(
            [_flat(rem, lo, hi) for rem, _, lo, hi in pieces], [o.view(torch.int32) for o in outs]
        )

    def values(self, value: torch.Tensor, low: torch.Tensor | None) -> torch.Tensor:
        high = low.view(torch.int16).to(torch.int32)
        return (high * 65536 + value.to(torch.int32)).view(torch.float32)

    def store(self, value, low, new, old, skip) -> None:  # type: ignore[no-untyped-def]
        bits = torch.where(skip, old, new).view(torch.int32)
        high = (bits + HALF_ULP) >> 16  # round half away from zero, as `split`
        value.copy_(bits - high * 65536)
        low.copy_(high.to(torch.int16).view(torch.bfloat16))
