"""fp32 masters kept as bf16 parameters plus 16-bit remainders (`store_param_remainders`).

bf16 is the upper half of fp32 (same sign and exponent bits), so an fp32 master is its bf16
parameter's 16 bits and 16 more. Rounding the master to the parameter by adding half a bf16
ulp to its bits and keeping the upper half (round half away from zero; torch's `.to` rounds
ties to even, which differs only where the lower half is exactly 0x8000) leaves a lower half
that, read as a signed int16, makes the master again exactly:

    master_bits = (param_bits << 16) + remainder      (int32, two's complement)

So 2 bytes a parameter hold what the 4-byte master held, bit for bit. The arithmetic is in
int32 on views of fp32 scratch (products and sums stay inside int32 for every finite master:
`param_bits` is in [-32768, 32767] and `remainder` in [-32768, 32767]).
"""

from __future__ import annotations

import torch

__all__ = ["HALF_ULP", "join", "masters_of", "split", "store"]

HALF_ULP = 0x8000
"""Half a bf16 ulp in the low bits of an fp32's bit pattern."""


def join(bits: torch.Tensor, remainder: torch.Tensor) -> None:
    """`bits` (int32) holds the parameters' bf16 bits, sign-extended: make it the masters'
    fp32 bits by adding their `remainder` (int16)."""
    bits.mul_(1 << 16).add_(remainder)


def split(bits: torch.Tensor, high: torch.Tensor) -> None:
    """`bits` (int32) holds the masters' fp32 bits: `high` (int32) becomes the rounded
    parameters' bf16 bits and `bits` the remainders (both within int16's range)."""
    torch.add(bits, HALF_ULP, out=high).bitwise_right_shift_(16)
    bits.sub_(high, alpha=1 << 16)


def masters_of(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """A new fp32 tensor: the masters of a bf16 `param` and its `remainder` (same shape)."""
    bits = param.view(torch.int16).to(torch.int32)
    join(bits, remainder.view(bits.shape))
    return bits.view(torch.float32)


def store(master: torch.Tensor, param: torch.Tensor, remainder: torch.Tensor) -> None:
    """Write an fp32 `master` into a bf16 `param` and its `remainder` (same numel)."""
    bits = master.reshape(-1).view(torch.int32).clone()
    high = torch.empty_like(bits)
    split(bits, high)
    param.view(-1).view(torch.int16).copy_(high)
    remainder.view(-1).copy_(bits)
