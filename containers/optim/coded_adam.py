"""Adam's moments in 8-bit codes: `moment_dtype = "8bit"`, 2.25 bytes a parameter.

A group of `LeanAdam(W)` with `moment_dtype = "8bit"` keeps, for each parameter of two or more
dimensions, `exp_avg = {"code": int8, "scale": fp32}` and `exp_avg_sq = {"code": uint8,
"scale": fp32}`: the codes of `containers.optim.moment_codes`, one scale a block of 32 within
a row (`benchmarks/bench_moment_codes.py`, `bench_lean_state.py`). Parameters of fewer
dimensions (biases, norm weights: few bytes, and a 1-D shard may cut any block), and matrices
whose rows hold 4 elements or fewer (where a block's scales cost more than bf16 saves), keep
bf16 moments. For a sharded parameter the scales are a DTensor placed as the parameter over
the whole tensor's blocks, so DCP reshards codes and scales element for element wherever rows
are cut; a parameter whose shards cut a row inside a block keeps bf16 moments (said once), and
a checkpoint moving it to or from a layout that codes it converts on load.

A step decodes a run of a parameter's rows into fp32 scratch, runs torch's fused kernel there
with the parameter and gradient, and encodes the rows back: so a coded step is, bit for bit,
torch's fused step on the decoded moments followed by encoding them (tests hold it). Encoding
what was decoded gives the same codes, so a step skipped by `found_inf` changes nothing.
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
from containers.tensors import local, scratch, scratch_numel

__all__ = [
    "CODED",
    "coded",
    "coded_adam",
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
    """Whether a coded group keeps `p`'s moments in codes (else in `FALLBACK`): a matrix
    whose rows are long enough for codes to take fewer bytes than bf16 (2 + 8 / 4 = 4 bytes
    an element at 4 a row) and, sharded, cut only between blocks (`cut_inside`)."""
    return p.dim() >= 2 and p.shape[-1] > 4 and cut_inside(p) is None


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def cut_inside(p: torch.Tensor) -> int | None:
    """The first column at which a shard of `p` (on any rank) cuts a row inside a block, so
    that its codes could not move whole between layouts; None where none does."""
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
    """Log, once for each shape and placement, that `p` keeps bf16 moments in a coded group
    because its shards cut rows inside blocks (tensor parallelism's column cuts, e.g.)."""
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
        stride=_contiguous_stride(shape),
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
    """A coded moment (`{"code", "scale"}`) as a tensor of `dtype`; any other as it is. Codes
    of the whole tensor (plain tensors) for a sharded parameter `p` (a layout whose shards
    cut its blocks: `in_form_of` loads them whole) give `p`'s piece, placed as `p`."""
    if not isinstance(value, dict):
        return value
    _, _, decode = _CODECS[name]
    code, scale = value["code"], value["scale"]
    out = torch.empty_like(code, dtype=torch.float32)
    decode(local(code), local(scale), local(out))
    if isinstance(p, DTensor) and not isinstance(out, DTensor):
        # this rank's piece of the whole, cut here (every rank holds the whole: no collective)
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
    """`p`'s `state` with each Adam moment in the form flat `keys` hold it under `prefix`
    (`state.<fqn>`): a tensor where they hold `<prefix>.exp_avg`, codes where they hold
    `<prefix>.exp_avg.code` (for a checkpoint of another `moment_dtype` to load into); and
    which moments a load converts, as (name, "tensor -> codes" or "codes -> tensor").

    A refitted moment is a template (zeros, or with `materialize` False meta tensors of the
    whole tensor's shape): the load converts what it receives into the optimizer's form. A
    tensor template takes the dtype `keys` map its key to (the checkpoint's: a bf16 moment is
    read as bf16), else fp32.
    Codes for a parameter whose shards here cut its blocks are templates of the whole tensor
    (every rank reads all of them, `decode_moment` takes its piece): a conversion's cost, once."""
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
            else:  # (a layout that cuts its blocks: the whole tensor's codes, on every rank)
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


@torch.no_grad()
def coded_adam(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[dict[str, torch.Tensor]],
    exp_avg_sqs: list[dict[str, torch.Tensor]],
    steps: list[torch.Tensor],
    *,
    kernel: Callable[..., None],
    settings: dict[str, Any],
) -> None:
    """Torch's fused `kernel` over coded moments, a run of rows at a time (see the module
    docstring). `steps` hold the count this update is (the caller adds and takes back)."""
    for i, param in enumerate(params):
        p, g = local(param), local(grads[i])
        m, v = exp_avgs[i], exp_avg_sqs[i]
        codes = [local(m["code"]), local(m["scale"]), local(v["code"]), local(v["scale"])]
        if not p.numel():
            continue
        contiguous = all(t.is_contiguous() for t in (p, g, *codes))
        if not contiguous:
            _step_rows(kernel, settings, p, g, codes, steps[i])
            continue
        last = p.shape[-1]
        rows = p.numel() // last
        per = max(1, scratch_numel(p.device) // (2 * last))
        flat = [t.view(rows, -1) for t in (p, g, *codes)]
        for start in range(0, rows, per):
            _step_rows(kernel, settings, *(t[start : start + per] for t in flat[:2]),
                       [t[start : start + per] for t in flat[2:]], steps[i])  # fmt: skip


def _step_rows(
    kernel: Callable[..., None],
    settings: dict[str, Any],
    p: torch.Tensor,
    g: torch.Tensor,
    codes: list[torch.Tensor],
    step: torch.Tensor,
) -> None:
    """Decode, step and encode one run of rows (`codes`: exp_avg's code and scale, then
    exp_avg_sq's)."""
    if p.is_contiguous():
        n = p.numel()
        buffer = scratch(p.device, 2 * n)
        m, v = buffer[:n].view(p.shape), buffer[n:].view(p.shape)
    else:  # the fused kernel pairs elements in memory order: the moments laid out as `p`
        m, v = (torch.empty_like(p, dtype=torch.float32) for _ in range(2))
    decode_signed(codes[0], codes[1], m)
    decode_log(codes[2], codes[3], v)
    kernel([p], [g], [m], [v], [], [step], **settings)
    encode_signed(m, codes[0], codes[1])
    encode_log(v, codes[2], codes[3], checked=False)  # (Adam's second moment: >= 0)
