"""Codecs: how a param group's state is stored between steps, decoded into fp32 for torch's
fused kernel and encoded back.

A *moment codec* keeps one Adam moment of a parameter: `Dense` (a tensor of a dtype) or
`RowCodes`, the base of block-coded formats (`codes8`, `codes4`). A *master codec* says what
the kernel steps for a parameter: the parameter itself, an fp32 master, or the master as the
bf16 parameter plus an int16 remainder. The tables of both are `containers.update.forms`.

Codecs work on *pieces*: `(stored, lo, hi)`, elements [lo, hi) of one parameter's stored
moment, cut by the driver at multiples of `row(stored)` (blocks never straddle a cut). A
stored form already in the dtype the kernel steps is used as it is (`direct`: no copy), so an
fp32 plan is torch's fused step bit for bit.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as _piece

from containers.tensors import local

__all__ = [
    "BF16_FUSED_DEVICES",
    "BLOCK",
    "HALF_ULP",
    "Dense",
    "Fp32Masters",
    "MasterCodec",
    "MomentCodec",
    "Piece",
    "Remainders",
    "RowCodes",
    "as_blocks",
    "join",
    "kept",
    "split",
]

logger = logging.getLogger(__name__)

# Whose fused Adam/AdamW takes bf16 moments beside fp32 values (elsewhere: fp32 scratch).
BF16_FUSED_DEVICES = frozenset({"cuda"})

Piece = tuple[Any, int, int]
"""A stored moment (local) and the run of its elements [lo, hi) that a piece covers."""


class MomentCodec:
    """One moment's stored form; subclasses say how it is made, decoded and encoded."""

    name = ""
    bytes_per_value = 4.0  # steady bytes a value takes, block scales included
    dtype = torch.float32  # of its tensors (a coded form: of the moments it keeps uncoded)
    label = "tensor"  # the form, in a log line
    adam_only = False  # codes of Adam's two moments only (no amsgrad, no other optimizer)

    def new(self, moment: str, p: torch.Tensor) -> Any:
        """A zero moment named `moment` for parameter `p` (a DTensor's placed as `p`)."""
        raise NotImplementedError

    def holds(self, stored: Any) -> bool:
        """Whether `stored` (a state entry, any form) is in this codec's form."""
        return False

    def from_values(self, moment: str, values: torch.Tensor, p: torch.Tensor) -> Any:
        """`values` (any float dtype, shaped and placed as `p`) in this codec's form."""
        raise NotImplementedError

    def to_values(self, moment: str, stored: Any, p: Any = None) -> torch.Tensor:
        """The fp32 values of `stored` (a form this codec `holds`); whole-tensor codes for a
        sharded `p` give `p`'s piece."""
        raise NotImplementedError

    def template(self, moment: str, p: torch.Tensor, materialize: bool) -> Any:
        """A form to load this codec's checkpoint entries into (zeros, or meta)."""
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


def kept(skip: torch.Tensor, stored: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`new` where not `skip`, else `stored`, in `stored`'s dtype: selected in fp32, since
    inductor's CPU code selects 8- and 16-bit values one lane at a time."""
    return torch.where(skip, stored.float(), new.float()).to(stored.dtype)


def _flat(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of `t` (a view; the driver hands tensors in flat, one call)."""
    return t[lo:hi] if t.dim() == 1 else t.view(-1)[lo:hi]


class Dense(MomentCodec):
    """A tensor of `dtype` shaped as the parameter: decoding widens exactly, encoding rounds
    to nearest even (exact for values the dtype holds, so a skipped step changes nothing)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = str(dtype).removeprefix("torch.")
        self.bytes_per_value = float(dtype.itemsize)

    def new(self, moment: str, p: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(p, dtype=self.dtype)

    def holds(self, stored: Any) -> bool:
        return isinstance(stored, torch.Tensor)

    def from_values(self, moment: str, values: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return values.to(device=p.device, dtype=self.dtype)

    def to_values(self, moment: str, stored: Any, p: Any = None) -> torch.Tensor:
        return stored.float()

    def template(self, moment: str, p: torch.Tensor, materialize: bool) -> torch.Tensor:
        if materialize:
            return torch.zeros_like(p, dtype=self.dtype)
        return torch.empty(p.shape, dtype=self.dtype, device="meta")

    def direct(self, stored: Any, dtype: torch.dtype) -> bool:
        # torch's CUDA kernel takes bf16 moments beside fp32 values as they are
        fused_bf16 = stored.device.type in BF16_FUSED_DEVICES and dtype == torch.float32
        return stored.dtype == dtype or (fused_bf16 and stored.dtype == torch.bfloat16)

    def decode(self, moment: str, pieces: Sequence[Piece], outs: Sequence[torch.Tensor]) -> None:
        torch._foreach_copy_(list(outs), [_flat(s, lo, hi) for s, lo, hi in pieces])

    def encode(self, moment: str, outs: Sequence[torch.Tensor], pieces: Sequence[Piece]) -> None:
        torch._foreach_copy_([_flat(s, lo, hi) for s, lo, hi in pieces], list(outs))

    def graphs(self, stored: Any) -> bool:
        return stored.is_contiguous()

    def values(self, moment: str, stored: Any, consts: Sequence[torch.Tensor]) -> torch.Tensor:
        return stored.float()

    def store(self, moment, stored, new, skip, consts) -> None:  # type: ignore[no-untyped-def]
        stored.copy_(kept(skip, stored, new))


BLOCK = 32
"""Elements of a row that share one scale in the block codes (`RowCodes.BLOCK`)."""


def as_blocks(t: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """`t` as (rows, blocks, `block`), a zero-padded copy if its rows are not whole blocks."""
    last = t.shape[-1] if t.dim() else 1
    r = t.reshape(-1, last)
    if last % block:
        r = torch.nn.functional.pad(r, (0, -last % block))
    return r.view(r.shape[0], r.shape[1] // block, block)


class RowCodes(MomentCodec):
    """Adam's moments as `{CODE: codes, "scale": fp32}` in blocks of `BLOCK` consecutive
    elements of a row (the last may be shorter), each block with its own scale, so no block
    crosses a row cut or a column cut at a multiple of `BLOCK`. A sharded parameter's codes
    and scales are DTensors placed as it, so DCP reshards them exactly. Parameters under 2-D
    (a 1-D shard may cut any block), rows shorter than `MIN_ROW` (scales would cost more
    than the fallback saves) and shards that cut a row inside a block keep `FALLBACK`.

    A subclass gives the codes' dtype and shape, and how rows of blocks are coded."""

    adam_only = True
    BLOCK = BLOCK
    CODE = "code"
    MIN_ROW = 5
    FALLBACK = Dense(torch.bfloat16)
    dtype = FALLBACK.dtype
    MOMENTS = ("exp_avg", "exp_avg_sq")  # exp_avg signed, exp_avg_sq >= 0

    def code_dtype(self, moment: str) -> torch.dtype:
        raise NotImplementedError

    PER_BYTE = 1  # codes a byte holds, packed along the row (a coded row is a multiple)

    def encode_rows(
        self, moment: str, values: torch.Tensor, code: torch.Tensor, scale: torch.Tensor
    ) -> None:
        """Write the codes and scales of fp32 `values` (rows, columns) into `code`, `scale`."""
        raise NotImplementedError

    def decode_rows(
        self, moment: str, code: torch.Tensor, scale: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Write the fp32 values of rows of `code` under `scale` into `out` (rows, columns)."""
        raise NotImplementedError

    # Shapes and placement.

    def scale_shape(self, shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
        """The shape of a tensor's block scales: its rows, then the blocks of a row."""
        if len(shape) == 0:
            return (1,)
        return (*shape[:-1], -(-shape[-1] // self.BLOCK))

    def code_shape(self, shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
        """The shape of a tensor's codes (rows of whole bytes)."""
        return (*shape[:-1], -(-shape[-1] // self.PER_BYTE))

    def keeps(self, p: torch.Tensor) -> bool:
        """Whether `p`'s moments are codes (else `FALLBACK`)."""
        return (
            p.dim() >= 2
            and p.shape[-1] >= self.MIN_ROW
            and p.shape[-1] % self.PER_BYTE == 0
            and self.cut_inside(p) is None
        )

    def cut_inside(self, p: torch.Tensor) -> int | None:
        """The first column where a shard of `p` (any rank) cuts a row inside a block, or None."""
        if not isinstance(p, DTensor) or p.dim() < 2:
            return None
        return self._cut_inside(tuple(p.shape), tuple(p.device_mesh.shape), tuple(p.placements))

    @functools.lru_cache(maxsize=256)  # noqa: B019 (codecs live as long as the process)
    def _cut_inside(
        self, shape: tuple[int, ...], mesh: tuple[int, ...], placements: tuple
    ) -> int | None:
        last = len(shape) - 1
        if not any(isinstance(pl, Shard) and pl.dim in (-1, last) for pl in placements):
            return None  # cuts between rows only
        scales, codes = self.scale_shape(shape), self.code_shape(shape)
        # Every rank's piece (torch's own split, private: it takes a coordinate other than ours).
        for coordinate in itertools.product(*map(range, mesh)):
            where = list(coordinate)
            piece, offset = _piece(shape, mesh, where, placements)
            s_piece, s_offset = _piece(scales, mesh, where, placements)
            c_piece, c_offset = _piece(codes, mesh, where, placements)
            if (
                tuple(s_piece) != self.scale_shape(tuple(piece))
                or offset[-1] != self.BLOCK * s_offset[-1]
                or tuple(c_piece) != self.code_shape(tuple(piece))
                or c_offset[-1] * self.PER_BYTE != offset[-1]
            ):
                return offset[-1]
        return None

    def announce(self, p: torch.Tensor) -> None:
        """Log once per shape and placement that `p` keeps `FALLBACK` moments (shards cut
        its blocks)."""
        column = self.cut_inside(p)
        if column is None or p.shape[-1] < self.MIN_ROW:
            return
        _say_once(
            f"moment_dtype = {self.name!r}: matrices of shape {tuple(p.shape)} sharded on "
            f"their last dimension ({p.placements}) are cut at column {column}, inside a "
            f"block of {self.BLOCK}: their moments stay {self.FALLBACK.name} (give each shard "
            f"a multiple of {self.BLOCK} columns for codes)"
        )

    def _placed(self, p: torch.Tensor, shape_of: Any, dtype: torch.dtype, device: Any) -> Any:
        """Zeros of shape `shape_of(p's shape)`, a DTensor placed as `p` where it is one."""
        piece = local(p)
        t = torch.zeros(shape_of(piece.shape), dtype=dtype, device=device or piece.device)
        if not isinstance(p, DTensor):
            return t
        shape = shape_of(p.shape)
        return DTensor.from_local(
            t, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )  # fmt: skip

    # Stored forms.

    def new(self, moment: str, p: torch.Tensor) -> Any:
        if not self.keeps(p):
            return self.FALLBACK.new(moment, p)
        self._check_moment(moment)
        return {
            self.CODE: self._placed(p, self.code_shape, self.code_dtype(moment), None),
            "scale": self._placed(p, self.scale_shape, torch.float32, None),
        }

    def _check_moment(self, moment: str) -> None:
        if moment not in self.MOMENTS:
            raise ValueError(
                f"moment_dtype = {self.name!r} codes {list(self.MOMENTS)}, not {moment!r} "
                "(amsgrad): set amsgrad = False or keep this group's moment_dtype = 'bfloat16'"
            )

    def holds(self, stored: Any) -> bool:
        return isinstance(stored, dict) and set(stored) == {self.CODE, "scale"}

    def from_values(self, moment: str, values: torch.Tensor, p: torch.Tensor) -> Any:
        if not self.keeps(p):
            return self.FALLBACK.from_values(moment, values, p)
        out = self.new(moment, p)
        rows = local(values).to(device=local(p).device, dtype=torch.float32)
        code, scale = local(out[self.CODE]), local(out["scale"])
        if rows.numel():
            last = rows.shape[-1]
            self.encode_rows(
                moment, rows.reshape(-1, last), code.view(-1, code.shape[-1]),
                scale.view(-1, scale.shape[-1]),
            )  # fmt: skip
        return out

    def to_values(self, moment: str, stored: Any, p: Any = None) -> torch.Tensor:
        code, scale = stored[self.CODE], stored["scale"]
        piece = local(code)
        columns = piece.shape[-1] * self.PER_BYTE
        out = torch.zeros((*piece.shape[:-1], columns), device=piece.device)
        if out.numel():
            self.decode_rows(
                moment, piece.view(-1, piece.shape[-1]),
                local(scale).reshape(-1, local(scale).shape[-1]), out.view(-1, columns),
            )  # fmt: skip
        if isinstance(p, DTensor) and not isinstance(code, DTensor):
            # every rank holds the whole: slice locally, no collective
            out = distribute_tensor(
                out.to(local(p).device), p.device_mesh, p.placements, src_data_rank=None
            )
        elif isinstance(code, DTensor):
            shape = (*code.shape[:-1], code.shape[-1] * self.PER_BYTE)
            out = DTensor.from_local(
                out, code.device_mesh, code.placements, run_check=False,
                shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride(),
            )  # fmt: skip
        return out

    def template(self, moment: str, p: torch.Tensor, materialize: bool) -> Any:
        if materialize and self.keeps(p):
            return self.new(moment, p)
        # shards cut its blocks: the whole tensor's codes, on every rank
        device = local(p).device if materialize else "meta"
        return {
            self.CODE: torch.zeros(
                self.code_shape(p.shape), dtype=self.code_dtype(moment), device=device
            ),
            "scale": torch.zeros(self.scale_shape(p.shape), device=device),
        }

    # The step.

    def _rows(self, stored: dict[str, torch.Tensor], lo: int, hi: int) -> tuple[Any, ...]:
        """The code and scale rows of elements [lo, hi) (whole rows), and the row length."""
        code, scale = stored[self.CODE], stored["scale"]
        last = code.shape[-1] * self.PER_BYTE
        rows = slice(lo // last, hi // last)
        return code.view(-1, code.shape[-1])[rows], scale.view(-1, scale.shape[-1])[rows], last

    def row(self, stored: Any) -> int:
        return stored[self.CODE].shape[-1] * self.PER_BYTE if isinstance(stored, dict) else 1

    def direct(self, stored: Any, dtype: torch.dtype) -> bool:
        return not isinstance(stored, dict) and stored.dtype == dtype

    def decode(self, moment: str, pieces: Sequence[Piece], outs: Sequence[torch.Tensor]) -> None:
        self._each(
            pieces, outs, lambda p, o: self.FALLBACK.decode(moment, p, o),
            lambda code, scale, rows: self.decode_rows(moment, code, scale, rows),
        )  # fmt: skip

    def encode(self, moment: str, outs: Sequence[torch.Tensor], pieces: Sequence[Piece]) -> None:
        self._each(
            pieces, outs, lambda p, o: self.FALLBACK.encode(moment, o, p),
            lambda code, scale, rows: self.encode_rows(moment, rows, code, scale),
        )  # fmt: skip

    def _each(
        self,
        pieces: Sequence[Piece],
        outs: Sequence[torch.Tensor],
        dense: Any,
        coded: Any,
    ) -> None:
        """`dense(pieces, outs)` of the fallback's pieces at once, then `coded(code rows,
        scale rows, out rows)` of each coded piece."""
        plain = [(piece, out) for piece, out in zip(pieces, outs) if not isinstance(piece[0], dict)]
        if plain:
            dense(*zip(*plain))
        for (stored, lo, hi), out in zip(pieces, outs):
            if isinstance(stored, dict):
                code, scale, last = self._rows(stored, lo, hi)
                coded(code, scale, out.view(-1, last))

    def graphs(self, stored: Any) -> bool:
        """Codes whose rows are whole blocks (a flat view's blocks are the rows'), or dense."""
        if not isinstance(stored, dict):
            return stored.is_contiguous()
        code = stored[self.CODE]
        columns = code.shape[-1] * self.PER_BYTE if code.dim() else 0
        return columns > 0 and columns % self.BLOCK == 0 and code.is_contiguous()


_said: set[str] = set()


def _say_once(line: str) -> None:
    if line not in _said:
        _said.add(line)
        logger.info(line)


# Master codecs.

HALF_ULP = 0x8000  # half a bf16 ulp in the low bits of an fp32's bit pattern

MasterPiece = tuple[torch.Tensor, Any, int, int]
"""The stepped tensor (the parameter, the master, or the remainder), the model's
low-precision parameter (None without one), elements [lo, hi)."""


def join(bits: torch.Tensor, remainder: torch.Tensor) -> None:
    """Turn `bits` (int32: sign-extended bf16 bits) into fp32 master bits with `remainder`
    (int16, or int32 sign-extended: twice as fast)."""
    torch.add(remainder, bits, alpha=1 << 16, out=bits)  # one pass


def split(bits: torch.Tensor, high: torch.Tensor, remainder: torch.Tensor) -> None:
    """Write fp32 master `bits` (int32; overwritten) as rounded bf16 bits into `high` and
    the remainder into `remainder` (both int16). The rounding adds a multiple of 2^16, so the
    remainder is the lower half of `bits` as it is (an int32 -> int16 copy keeps it)."""
    remainder.copy_(bits)
    bits.add_(HALF_ULP).bitwise_right_shift_(16)
    high.copy_(bits)


class MasterCodec:
    """The parameter itself: the kernel steps `value` in place and nothing follows it."""

    name = "param"
    decoded = False  # the kernel steps fp32 scratch decoded from the pieces
    spare = False  # whether its decode works in one more fp32 scratch region a piece

    def decode(
        self,
        pieces: Sequence[MasterPiece],
        outs: Sequence[torch.Tensor],
        spare: Sequence[torch.Tensor],
    ) -> None:
        """fp32 values of `pieces` into `outs` (only where `decoded`); `spare`: a region a
        piece where `self.spare`, free to use."""
        raise NotImplementedError

    def encode(self, outs: Sequence[torch.Tensor], pieces: Sequence[MasterPiece]) -> None:
        """Store the stepped fp32 `outs` (free to overwrite) into `pieces`."""
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
        low.copy_(kept(skip, low, new))


class Remainders(MasterCodec):
    """fp32 masters kept as the bf16 parameters plus int16 remainders (`value`), joined into
    scratch. bf16 is the upper half of fp32: rounding a master by adding half a bf16 ulp to
    its bits and keeping the upper half (round half away from zero; torch's `.to` rounds ties
    to even) leaves a lower half that, as a signed int16, restores the master exactly:
    bits = (param << 16) + remainder."""

    name = "remainders"
    decoded = True
    spare = True  # the remainders widened: an add of int16 to int32 is a slow mixed-dtype loop

    def decode(
        self,
        pieces: Sequence[MasterPiece],
        outs: Sequence[torch.Tensor],
        spare: Sequence[torch.Tensor],
    ) -> None:
        bits, wide = [out.view(torch.int32) for out in outs], [s.view(torch.int32) for s in spare]
        torch._foreach_copy_(
            bits + wide,
            [_flat(low, lo, hi).view(torch.int16) for _, low, lo, hi in pieces]
            + [_flat(rem, lo, hi) for rem, _, lo, hi in pieces],
        )  # sign-extended
        for b, w in zip(bits, wide):
            join(b, w)

    def encode(self, outs: Sequence[torch.Tensor], pieces: Sequence[MasterPiece]) -> None:
        for out, (rem, low, lo, hi) in zip(outs, pieces):
            split(out.view(torch.int32), _flat(low, lo, hi).view(torch.int16), _flat(rem, lo, hi))

    def values(self, value: torch.Tensor, low: torch.Tensor | None) -> torch.Tensor:
        high = low.view(torch.int16).to(torch.int32)
        return (high * 65536 + value.to(torch.int32)).view(torch.float32)

    def store(self, value, low, new, old, skip) -> None:  # type: ignore[no-untyped-def]
        bits = torch.where(skip, old, new).view(torch.int32)
        high = (bits + HALF_ULP) >> 16  # round half away from zero, as `split`
        value.copy_(bits - high * 65536)
        low.copy_(high.to(torch.int16).view(torch.bfloat16))
