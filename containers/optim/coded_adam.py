"""Adam's moments in 8-bit codes (`moment_dtype = "8bit"`): 2.25 bytes a parameter.

A coded parameter keeps `exp_avg = {"code": int8, "scale": fp32}` and `exp_avg_sq = {"code":
uint8, "scale": fp32}` (`moment_codes`); a sharded one's scales are a DTensor placed like it,
so DCP reshards both exactly. Parameters under 2-D (a 1-D shard may cut any block), rows of 4
or fewer elements (scales would cost more than bf16 saves) and shards that cut a row inside a
block keep bf16 moments. A step decodes rows into fp32 scratch, runs torch's fused kernel and
encodes back: bitwise torch's step on the decoded moments; a skipped step changes nothing.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as _piece

from containers.optim.moment_codes import (
    BLOCK,
    decode_log,
    decode_signed,
    encode_log,
    encode_signed,
    scale_shape,
)
from containers.tensors import local

__all__ = [
    "CODED",
    "coded",
    "decode_moment",
    "encode_moment",
    "in_form_of",
    "new_moments",
    "say_cuts",
]

logger = logging.getLogger(__name__)

CODED = "8bit"
"""The `moment_dtype` of coded moments."""

Codec = tuple[torch.dtype, Callable[..., None], Callable[..., None]]
_CODECS: dict[str, Codec] = {
    "exp_avg": (torch.int8, encode_signed, decode_signed),
    "exp_avg_sq": (torch.uint8, encode_log, decode_log),
}
FALLBACK = torch.bfloat16
"""The dtype of the moments of a parameter too small to code (fewer than 2 dimensions)."""


def coded(p: torch.Tensor) -> bool:
    """Whether a coded group keeps `p`'s moments in codes (else `FALLBACK`): a matrix with
    rows over 4 elements (where codes beat bf16) whose shards cut only between blocks."""
    return p.dim() >= 2 and p.shape[-1] > 4 and cut_inside(p) is None


def cut_inside(p: torch.Tensor) -> int | None:
    """The first column where a shard of `p` (any rank) cuts a row inside a block, or None."""
    if not isinstance(p, DTensor) or p.dim() < 2:
        return None
    return _cut_inside(tuple(p.shape), tuple(p.device_mesh.shape), tuple(p.placements))


@functools.lru_cache(maxsize=256)
def _cut_inside(shape: tuple[int, ...], mesh: tuple[int, ...], placements: tuple) -> int | None:
    last = len(shape) - 1
    if not any(isinstance(pl, Shard) and pl.dim in (-1, last) for pl in placements):
        return None  # cuts between rows only
    scales = scale_shape(shape)
    # Every rank's piece (torch's own split, private: it takes a coordinate other than ours).
    for coordinate in itertools.product(*map(range, mesh)):
        piece, offset = _piece(shape, mesh, list(coordinate), placements)
        s_piece, s_offset = _piece(scales, mesh, list(coordinate), placements)
        if tuple(s_piece) != scale_shape(tuple(piece)) or offset[-1] != BLOCK * s_offset[-1]:
            return offset[-1]
    return None


_said: set[str] = set()


def say_cuts(p: torch.Tensor) -> None:
    """Log once per shape and placement that `p` keeps bf16 moments (shards cut blocks)."""
    column = cut_inside(p)
    if column is None or p.shape[-1] <= 4:
        return
    line = (
        f"moment_dtype = '8bit': matrices of shape {tuple(p.shape)} sharded on their last "
        f"dimension ({p.placements}) are cut at column {column}, inside a block of {BLOCK}: "
        "their moments stay bf16 (give each shard a multiple of 32 columns for codes)"
    )
    if line not in _said:
        _said.add(line)
        logger.info(line)


def _scales(p: torch.Tensor) -> torch.Tensor:
    """Zero block scales for `p`: a DTensor placed as `p` over the whole tensor's blocks."""
    piece = local(p)
    s = torch.zeros(scale_shape(piece.shape), dtype=torch.float32, device=piece.device)
    if not isinstance(p, DTensor):
        return s
    shape = scale_shape(p.shape)
    return DTensor.from_local(
        s, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape),
        stride=torch.empty(shape, device="meta").stride(),
    )  # fmt: skip


def new_moments(p: torch.Tensor) -> dict[str, Any]:
    """Zero `exp_avg` and `exp_avg_sq` for `p` in a coded group."""
    return {n: _new_moment(n, p) for n in _CODECS}


def _new_moment(name: str, p: torch.Tensor) -> Any:
    if not coded(p):
        return torch.zeros_like(p, dtype=FALLBACK)
    return {"code": torch.zeros_like(p, dtype=_CODECS[name][0]), "scale": _scales(p)}


def encode_moment(name: str, values: torch.Tensor, p: torch.Tensor) -> Any:
    """`values` (of `p`'s moment `name`, any float dtype) as a coded group keeps them."""
    if not coded(p):
        return values.to(device=p.device, dtype=FALLBACK)
    if name not in _CODECS:
        raise ValueError(
            f"moment_dtype = '8bit' codes {sorted(_CODECS)}, not {name!r} (amsgrad): set "
            "amsgrad = False or keep this group's moment_dtype = 'bfloat16'"
        )
    _, encode, _ = _CODECS[name]
    out = _new_moment(name, p)
    encode(local(values).to(device=local(p).device), local(out["code"]), local(out["scale"]))
    return out


def decode_moment(name: str, value: Any, dtype: torch.dtype, p: Any = None) -> Any:
    """A coded moment (`{"code", "scale"}`) as a tensor of `dtype`; any other as it is.

    Whole-tensor codes for a sharded `p` (as `in_form_of` loads them) give `p`'s piece."""
    if not isinstance(value, dict):
        return value
    _, _, decode = _CODECS[name]
    code, scale = value["code"], value["scale"]
    out = torch.empty_like(code, dtype=torch.float32)
    decode(local(code), local(scale), local(out))
    if isinstance(p, DTensor) and not isinstance(out, DTensor):
        # every rank holds the whole: slice locally, no collective
        out = distribute_tensor(
            out.to(local(p).device), p.device_mesh, p.placements, src_data_rank=None
        )
    return out.to(dtype)


def in_form_of(
    p: torch.Tensor,
    state: dict[str, Any],
    keys: Collection[str] | Mapping[str, torch.dtype | None],
    prefix: str,
    materialize: bool,
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """`p`'s `state` with each moment in the form the checkpoint `keys` hold it under `prefix`.

    A moment saved as a tensor (`<prefix>.exp_avg`) or as codes (`<prefix>.exp_avg.code`)
    unlike ours gets a template (zeros, or meta if not `materialize`) that the load converts.
    Tensor templates take the saved dtype from `keys` if given, else fp32. Codes for a
    parameter whose shards cut its blocks are whole-tensor templates on every rank.

    Returns:
        The state, and the converted moments as (name, "tensor -> codes" | "codes -> tensor").
    """
    out, changed = state, []
    for name, (dtype, _, _) in _CODECS.items():
        ours = state.get(name)
        if isinstance(ours, dict) and f"{prefix}.{name}" in keys:
            saved = keys.get(f"{prefix}.{name}") if isinstance(keys, Mapping) else None
            kind = saved if saved is not None and saved.is_floating_point else torch.float32
            template: Any = (
                torch.zeros_like(p, dtype=kind)
                if materialize
                else torch.empty(p.shape, dtype=kind, device="meta")
            )
            changed.append((name, "tensor -> codes"))
        elif isinstance(ours, torch.Tensor) and f"{prefix}.{name}.code" in keys:
            if materialize and coded(p):
                template = _new_moment(name, p)
            else:  # shards cut its blocks: the whole tensor's codes, on every rank
                device = local(p).device if materialize else "meta"
                template = {
                    "code": torch.zeros(p.shape, dtype=dtype, device=device),
                    "scale": torch.zeros(scale_shape(p.shape), device=device),
                }
            changed.append((name, "codes -> tensor"))
        else:
            continue
        out = {**out, name: template}
    return out, changed
