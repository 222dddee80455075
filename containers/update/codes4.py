"""4-bit moments (`moment_dtype = "4bit"`): 1.25 bytes a parameter, two codes a byte in
blocks of 32 within rows, each block under its fp32 maximum (`codecs.RowCodes`: they reshard
exactly as the 8-bit codes). As torchao's 4-bit AdamW, each block has its own scale and the
second moment never decodes below zero:

- first moment (signed): a sign bit and 3 bits of magnitude, the nearest of
  `SIGNED_MAGNITUDES` times the block's largest magnitude;
- second moment (>= 0): code 0 is 0, code c >= 1 is 2^-(c - 1) x the block maximum, the
  nearest in log scale; smaller nonzero values take code 15, an overestimate (a smaller
  update, never a division by `eps` alone).

Codes are found by comparing with fixed fp32 thresholds (`torch.bucketize`), so they are
device-independent, and a decoded block encodes to the same codes and scale.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from containers.update.codecs import RowCodes, as_blocks, kept

__all__ = ["LOG_STEPS", "SIGNED_MAGNITUDES", "Codes4"]

SIGNED_MAGNITUDES = (0.0, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)
LOG_STEPS = 15  # codes 1..15: 2^0 .. 2^-14 of the block maximum


@functools.cache
def tables(device: torch.device) -> tuple[torch.Tensor, ...]:
    """Signed values of codes 0..15 (sign bit 8), their magnitudes' thresholds (midpoints),
    values of the log codes 0..15, and their thresholds (geometric midpoints, ascending)."""
    mags = torch.tensor(SIGNED_MAGNITUDES, dtype=torch.float64)
    signed = torch.cat([mags, -mags])
    mag_edges = (mags[1:] + mags[:-1]) / 2
    c = torch.arange(1, LOG_STEPS + 1, dtype=torch.float64)
    logs = torch.cat([torch.zeros(1, dtype=torch.float64), torch.exp2(-(c - 1))])
    # ratio r > 0 takes code 15 - bucketize(r, edges): edges between 2^-14 .. 2^0, ascending
    log_edges = torch.exp2(-(c[:-1] - 0.5)).flip(0)
    return tuple(t.float().to(device) for t in (signed, mag_edges, logs, log_edges))


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 (..., 2n) as n bytes: even columns low, odd columns high."""
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """`_pack`'s inverse: (..., n) bytes as (..., 2n) codes (int64, for table lookups)."""
    low, high = packed & 15, packed >> 4
    return torch.stack([low, high], -1).view(*packed.shape[:-1], -1).long()


def codes_of(moment: str, blocks: torch.Tensor, consts: Sequence[torch.Tensor]) -> tuple:
    """uint8 codes of fp32 `blocks` (..., BLOCK) and block maxima (..., 1)."""
    if moment == "exp_avg":
        top = blocks.abs().amax(-1, keepdim=True)
        ratio = blocks.abs() / top.clamp_min(torch.finfo(torch.float32).tiny)
        mag = torch.bucketize(ratio, consts[1], right=True)
        return (mag | ((blocks < 0) & (mag > 0)).to(mag.dtype) << 3).to(torch.uint8), top
    top = blocks.amax(-1, keepdim=True)
    ratio = blocks / top.clamp_min(torch.finfo(torch.float32).tiny)
    code = LOG_STEPS - torch.bucketize(ratio, consts[3], right=True)
    return torch.where(blocks > 0, code, 0).to(torch.uint8), top


def values_of(moment: str, codes: torch.Tensor, top: torch.Tensor, consts: Sequence) -> Any:
    """fp32 values of codes (..., BLOCK) under block maxima `top` (..., 1)."""
    table = consts[0] if moment == "exp_avg" else consts[2]
    return table[codes] * top


class Codes4(RowCodes):
    """4-bit row codes of Adam's moments, two a byte."""

    name = "4bit"
    label = "4-bit codes"
    bytes_per_value = 0.625  # half a byte, and an fp32 scale a block of 32
    CODE = "nibbles"
    PER_BYTE = 2

    def code_dtype(self, moment: str) -> torch.dtype:
        return torch.uint8

    def encode_rows(
        self, moment: str, values: torch.Tensor, code: torch.Tensor, scale: torch.Tensor
    ) -> None:
        codes, top = codes_of(moment, as_blocks(values, self.BLOCK), tables(values.device))
        columns = values.shape[-1]
        code.copy_(_pack(codes.view(codes.shape[0], -1)[:, :columns]))
        scale.copy_(top.view(scale.shape))

    def decode_rows(
        self, moment: str, code: torch.Tensor, scale: torch.Tensor, out: torch.Tensor
    ) -> None:
        codes = as_blocks(_unpack(code), self.BLOCK)
        values = values_of(moment, codes, scale.unsqueeze(-1), tables(code.device))
        out.copy_(values.view(values.shape[0], -1)[:, : out.shape[-1]])

    def constants(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        return tables(device)

    def values(self, moment: str, stored: Any, consts: Sequence[torch.Tensor]) -> torch.Tensor:
        if not isinstance(stored, dict):
            return stored.float()
        codes = _unpack(stored[self.CODE]).view(-1, self.BLOCK)
        return values_of(moment, codes, stored["scale"].view(-1, 1), consts)

    def store(self, moment, stored, new, skip, consts) -> None:  # type: ignore[no-untyped-def]
        if not isinstance(stored, dict):
            stored.copy_(kept(skip, stored, new))
            return
        codes, top = codes_of(moment, new.view(-1, self.BLOCK), consts)
        code, scale = stored[self.CODE], stored["scale"].view(-1, 1)
        code.copy_(kept(skip, code, _pack(codes).view(code.shape)))
        scale.copy_(torch.where(skip, scale, top))
