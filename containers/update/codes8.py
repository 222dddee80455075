"""8-bit moments (`moment_dtype = "8bit"`): 2.25 bytes a parameter, in blocks of 32 within
rows that a checkpoint reshards exactly (`codecs.RowCodes`).

- first moment (signed): `int8` times a per-block power of two, the smallest holding the
  block's largest magnitude (|code| <= 127; decoding is one exact multiply);
- second moment (>= 0): `uint8` log code below the block maximum (kept exactly in fp32):
  code 0 is 0, code c >= 1 is 2^(-40 (c - 1) / 254) x the maximum, the nearest in log scale;
  smaller nonzero values take code 255, an overestimate (a smaller update, never a division
  by `eps` alone). Log rounding beats linear rounding for this moment.

Both codes are elementwise arithmetic (`log2`, `exp2`, bit operations; no table reads, which
a compiled CPU kernel does one element at a time). A decoded value in fp32's normal range
sits half a code from either neighbour, so it encodes to the same code on any device; a value
within a few ulp of the boundary between two log codes may take either where another `log2`
rounds it (another device), as any fp32 result may differ there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from containers.update.codecs import BLOCK, RowCodes, as_blocks, kept

__all__ = [
    "BLOCK",
    "LOG_OCTAVES",
    "Codes8",
    "as_blocks",
    "decode_log",
    "decode_signed",
    "encode_log",
    "encode_signed",
    "from_blocks",
    "log_codes",
    "log_values",
    "scale_shape",
    "signed_codes",
    "signed_values",
]

LOG_OCTAVES = 40.0
_STEPS = 254  # codes 1..255
# A code's step, 40 / 254 = 20 / 127 of an octave, in units of 1/127 octave (exact in fp32).
_UNITS, _UNITS_PER_CODE = 127.0, 20.0


def scale_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a tensor's block scales: its rows, then the blocks of a row."""
    if len(shape) == 0:
        return (1,)
    return (*shape[:-1], -(-shape[-1] // BLOCK))


def from_blocks(blocks: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """`as_blocks`' inverse: the tensor of `shape` that `blocks` (padding dropped) hold."""
    last = shape[-1] if len(shape) else 1
    return blocks.reshape(blocks.shape[0], -1)[:, :last].reshape(shape)


def _check(
    values: torch.Tensor, code: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> None:
    if code.shape != values.shape or code.dtype != dtype:
        raise ValueError(
            f"moment code: want {dtype} of shape {tuple(values.shape)}, got {code.dtype} of "
            f"shape {tuple(code.shape)}"
        )
    want = scale_shape(values.shape)
    if tuple(scale.shape) != want or scale.dtype != torch.float32:
        raise ValueError(
            f"moment scales: want float32 of shape {want} (blocks of {BLOCK} a row), got "
            f"{scale.dtype} of shape {tuple(scale.shape)}"
        )
    if not (values.device == code.device == scale.device):
        raise ValueError(
            f"moment code: values on {values.device}, codes on {code.device}, scales on "
            f"{scale.device}; expected one device"
        )


@torch.no_grad()
def encode_signed(values: torch.Tensor, code: torch.Tensor, scale: torch.Tensor) -> None:
    """Write the int8 codes of `values` into `code` and each block's power of two into
    `scale` (an all-zero block takes 2^-126 and codes 0)."""
    _check(values, code, scale, torch.int8)
    if not values.numel():
        return
    codes, power = signed_codes(as_blocks(values.float()))
    code.copy_(from_blocks(codes, code.shape))
    scale.copy_(power.reshape(scale.shape))


def signed_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8 codes (as fp32) of fp32 `blocks` (..., BLOCK) and each block's power of two
    (..., 1); plain torch ops so inductor fuses them too."""
    top = (blocks.abs().amax(-1, keepdim=True) / 127).clamp_min(2.0**-126)
    # Smallest power of two >= top: top if its mantissa is 0, else the next exponent
    # (inf for a block holding a non-finite value).
    bits = top.view(torch.int32)
    above = (bits & 0x7F800000) + 0x00800000
    power = torch.where(bits & 0x007FFFFF == 0, bits, above).view(torch.float32)
    return (blocks * power.reciprocal()).round().clamp(-127, 127), power  # (exact)


def signed_values(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of int8 `codes` (..., BLOCK) with block scales (..., 1)."""
    return codes.float() * scale


def decode_signed(code: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """Write the values of int8 `code` with block scales `scale` into `out`."""
    _decode(code, scale, out, torch.int8, signed_values)


@torch.no_grad()
def encode_log(
    values: torch.Tensor, code: torch.Tensor, top: torch.Tensor, checked: bool = True
) -> None:
    """Write the uint8 log codes of `values` into `code` and block maxima into `top`.

    `checked`: verify `values >= 0` (a pass and a host sync)."""
    _check(values, code, top, torch.uint8)
    if not values.numel():
        return
    if checked and bool((values < 0).any()):
        raise ValueError("encode_log: a second moment must be >= 0; got a negative value")
    codes, peak = log_codes(as_blocks(values.float()))
    code.copy_(from_blocks(codes, code.shape))
    top.copy_(peak.reshape(top.shape))


def log_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Uint8 log codes of fp32 `blocks` (..., BLOCK) >= 0 and block maxima (..., 1); plain
    torch ops so inductor fuses them too."""
    peak = blocks.amax(-1, keepdim=True)
    below = peak.clamp_min(torch.finfo(torch.float32).tiny).log2() - blocks.log2()  # octaves
    c = (below * (_STEPS / LOG_OCTAVES) + 1.5).floor().clamp(1, 255)  # 0: inf -> 255
    return torch.where(blocks > 0, c, 0).to(torch.uint8), peak


def log_values(codes: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """fp32 values of uint8 log `codes` (..., BLOCK) below block maxima `top` (..., 1).

    2^(-20 (c - 1) / 127), at most 12 x 2^-23 of the exact value away (the exponent is
    rounded to fp32)."""
    c = codes.float()  # (a float compare: inductor's CPU code selects by 8-bit masks slowly)
    n = (c - 1) * _UNITS_PER_CODE  # below the maximum, in 1/127 octave
    return torch.where(c > 0, torch.exp2(n / -_UNITS), 0.0) * top


def decode_log(code: torch.Tensor, top: torch.Tensor, out: torch.Tensor) -> None:
    """Write the values of uint8 log `code` below block maxima `top` into `out`."""
    _decode(code, top, out, torch.uint8, log_values)


@torch.no_grad()
def _decode(
    code: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    dtype: torch.dtype,
    values: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> None:
    """`out` = `values(code blocks, their scales)`."""
    _check(out, code, scale, dtype)
    if out.numel():
        blocks = values(as_blocks(code), scale.reshape(-1, scale.shape[-1], 1))
        out.copy_(from_blocks(blocks, out.shape))


class Codes8(RowCodes):
    """8-bit row codes: int8 signed codes of `exp_avg`, uint8 log codes of `exp_avg_sq`."""

    name = "8bit"
    label = "8-bit codes"
    bytes_per_value = 1.125  # a code, and an fp32 scale a block of 32

    def code_dtype(self, moment: str) -> torch.dtype:
        return torch.int8 if moment == "exp_avg" else torch.uint8

    def encode_rows(
        self, moment: str, values: torch.Tensor, code: torch.Tensor, scale: torch.Tensor
    ) -> None:
        if moment == "exp_avg":
            encode_signed(values, code, scale)
        else:  # Adam's second moment is >= 0
            encode_log(values, code, scale, checked=False)

    def decode_rows(
        self, moment: str, code: torch.Tensor, scale: torch.Tensor, out: torch.Tensor
    ) -> None:
        (decode_signed if moment == "exp_avg" else decode_log)(code, scale, out)

    def values(self, moment: str, stored: Any, consts: Sequence[torch.Tensor]) -> torch.Tensor:
        if not isinstance(stored, dict):
            return stored.float()
        code, scale = stored["code"].view(-1, BLOCK), stored["scale"].view(-1, 1)
        if moment == "exp_avg":
            return signed_values(code, scale)
        return log_values(code, scale)

    def store(self, moment, stored, new, skip, consts) -> None:  # type: ignore[no-untyped-def]
        if not isinstance(stored, dict):
            stored.copy_(kept(skip, stored, new))
            return
        code, scale = stored["code"].view(-1, BLOCK), stored["scale"].view(-1, 1)
        blocks = new.view(-1, BLOCK)
        codes, scales = (signed_codes if moment == "exp_avg" else log_codes)(blocks)
        code.copy_(kept(skip, code, codes))
        scale.copy_(torch.where(skip, scale, scales))
