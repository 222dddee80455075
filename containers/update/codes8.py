"""8-bit moments (`moment_dtype = "8bit"`): 2.25 bytes a parameter.

A coded moment is `{"code": int8 | uint8, "scale": fp32}` in blocks of 32 within rows
(`containers.optim.moment_codes`): the first moment signed codes under a power of two, the
second log codes below the block maximum. A sharded parameter's scales are a DTensor placed
as it, so DCP reshards both exactly. Parameters under 2-D, rows of 4 or fewer elements and
shards that cut a row inside a block keep bf16 moments (`coded_adam.coded`). Cuts fall
between rows, so a piece is a run of whole rows and its blocks; decode and encode of a piece
are exact inverses of each other on what a code holds, so a skipped step changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from containers.optim.coded_adam import CODED, new_moments
from containers.optim.moment_codes import (
    BLOCK,
    decode_log,
    decode_signed,
    encode_log,
    encode_signed,
    log_codes,
    log_tables,
    log_values,
    signed_codes,
    signed_values,
)
from containers.update.moments import Dense, MomentCodec, Piece

__all__ = ["Codes8"]

_FALLBACK = Dense(torch.bfloat16)
_SIGNED = "exp_avg"  # the moment coded as signed values; the other, >= 0, as log codes


def _rows(stored: dict[str, torch.Tensor], lo: int, hi: int) -> tuple[torch.Tensor, ...]:
    """The code and scale rows of elements [lo, hi) (whole rows)."""
    code, scale = stored["code"], stored["scale"]
    last = code.shape[-1]
    rows = slice(lo // last, hi // last)
    return code.view(-1, last)[rows], scale.view(-1, scale.shape[-1])[rows]


class Codes8(MomentCodec):
    """8-bit row codes, bf16 where a parameter cannot hold them."""

    name = CODED
    bytes_per_value = 1.125  # a code, and an fp32 scale a block of 32

    def new(self, moment: str, p: torch.Tensor) -> Any:
        return new_moments(p)[moment]

    def row(self, stored: Any) -> int:
        return stored["code"].shape[-1] if isinstance(stored, dict) else 1

    def direct(self, stored: Any, dtype: torch.dtype) -> bool:
        return not isinstance(stored, dict) and stored.dtype == dtype

    def decode(self, moment: str, pieces: Sequence[Piece], outs: Sequence[torch.Tensor]) -> None:
        plain = [(piece, out) for piece, out in zip(pieces, outs) if not isinstance(piece[0], dict)]
        if plain:
            _FALLBACK.decode(moment, *zip(*plain))
        decode = decode_signed if moment == _SIGNED else decode_log
        for (stored, lo, hi), out in zip(pieces, outs):
            if isinstance(stored, dict):
                code, scale = _rows(stored, lo, hi)
                decode(code, scale, out.view(code.shape))

    def encode(self, moment: str, outs: Sequence[torch.Tensor], pieces: Sequence[Piece]) -> None:
        plain = [(out, piece) for piece, out in zip(pieces, outs) if not isinstance(piece[0], dict)]
        if plain:
            _FALLBACK.encode(moment, *zip(*plain))
        for (stored, lo, hi), out in zip(pieces, outs):
            if isinstance(stored, dict):
                code, scale = _rows(stored, lo, hi)
                if moment == _SIGNED:
                    encode_signed(out.view(code.shape), code, scale)
                else:  # Adam's second moment is >= 0
                    encode_log(out.view(code.shape), code, scale, checked=False)

    def graphs(self, stored: Any) -> bool:
        """Codes whose rows are whole blocks (a flat view's blocks are the rows'), or bf16."""
        if not isinstance(stored, dict):
            return stored.is_contiguous()
        code = stored["code"]
        return code.dim() > 0 and code.shape[-1] % BLOCK == 0 and code.is_contiguous()

    def constants(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        return log_tables(device)  # the log codes' values and thresholds

    def values(self, moment: str, stored: Any, consts: Sequence[torch.Tensor]) -> torch.Tensor:
        if not isinstance(stored, dict):
            return stored.float()
        code, scale = stored["code"].view(-1, BLOCK), stored["scale"].view(-1, 1)
        if moment == _SIGNED:
            return signed_values(code, scale).view(-1)
        return log_values(code, scale, consts[0]).view(-1)

    def store(self, moment, stored, new, skip, consts) -> None:  # type: ignore[no-untyped-def]
        if not isinstance(stored, dict):
            stored.copy_(torch.where(skip, stored.float(), new))
            return
        code, scale = stored["code"].view(-1, BLOCK), stored["scale"].view(-1, 1)
        blocks = new.view(-1, BLOCK)
        if moment == _SIGNED:
            codes, scales = signed_codes(blocks)
            codes = codes.to(torch.int8)
        else:
            codes, scales = log_codes(blocks, consts[1])
        code.copy_(torch.where(skip, code, codes))
        scale.copy_(torch.where(skip, scale, scales))
