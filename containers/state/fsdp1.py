"""FSDP1 model parts saved as FSDP2 writes them (ARCHITECTURE.md, "FSDP1 ...")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.optim import Optimizer

from containers.update.forms import CODED

__all__ = ["ELEMENTWISE", "FlatShards", "refuse_coded", "refuse_optimizers"]

ELEMENTWISE: tuple[type[Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)  # an element's update depends on it alone (and per-parameter scalars)

_STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


@dataclass(eq=False)
class _Unit:
    """One flat parameter: the group it is sharded over and where its parameters lie."""

    group: dist.ProcessGroup
    mesh: DeviceMesh
    placements: tuple[Shard | Replicate, ...]
    shard_numel: int  # elements of each rank's padded slice
    begins: list[int]  # each parameter's first element in the unsharded padded flat parameter


@dataclass(frozen=True, eq=False)
class _Piece:
    """This rank's part of one original parameter."""

    unit: _Unit
    shape: torch.Size
    offset: int  # where the part lies in this rank's slice of the flat parameter
    start: int  # its first element in the flattened full parameter
    numel: int
    begin: int  # where the whole parameter begins in the unsharded padded flat parameter
    owner: int  # the lowest group rank holding elements of it: its scalars are the truth


def _unit(module: FullyShardedDataParallel) -> _Unit:
    strategy = module.sharding_strategy
    if strategy not in _STRATEGIES:
        raise ValueError(
            f"FullyShardedDataParallel sharding_strategy = {strategy.name}: the containers "
            "support FULL_SHARD and HYBRID_SHARD; wrap with one of them"
        )
    if not module._use_orig_params:
        raise ValueError(
            "FullyShardedDataParallel(use_orig_params=False) hands the optimizer flat "
            "parameters without FQNs; wrap with use_orig_params=True"
        )
    group = module.process_group
    mesh = getattr(module, "_device_mesh", None)
    if strategy == ShardingStrategy.HYBRID_SHARD:
        if mesh is None or mesh.ndim != 2:
            raise ValueError(
                "FullyShardedDataParallel(sharding_strategy=HYBRID_SHARD) without a 2-D "
                "device_mesh: pass device_mesh=(replicate, shard) so checkpoints can say "
                "which ranks hold copies"
            )
        placements: tuple[Shard | Replicate, ...] = (Replicate(), Shard(0))
    else:
        if mesh is None:
            mesh = DeviceMesh.from_group(group, module.compute_device.type)
        placements = (Shard(0),)
    flat = module._handle.flat_param
    begins, at = [], 0
    for numel, padding in zip(flat._numels_with_padding, flat._is_padding_mask):
        if not padding:
            begins.append(at)
        at += numel
    return _Unit(group, mesh, placements, flat._sharded_size.numel(), begins)


class FlatShards:
    """FSDP1 parameters of `model_parts`; their flat state to and from full-shape DTensors."""

    def __init__(self, model_parts: Sequence[nn.Module]) -> None:
        self.pieces: dict[torch.Tensor, _Piece] = {}
        modules = (m for part in model_parts for m in part.modules())
        for module in modules:
            if not isinstance(module, FullyShardedDataParallel) or module._handle is None:
                continue
            unit = _unit(module)
            flat = module._handle.flat_param
            for i, (param, info) in enumerate(zip(flat._params, flat._shard_param_infos)):
                held = info.in_shard
                self.pieces[param] = _Piece(
                    unit=unit,
                    shape=flat._shapes[i],
                    offset=info.offset_in_shard if held else 0,
                    start=info.intra_param_start_idx if held else 0,
                    numel=info.numel_in_shard if held else 0,
                    begin=unit.begins[i],
                    owner=unit.begins[i] // unit.shard_numel if flat._shapes[i].numel() else 0,
                )
        self._by_fqn: dict[str, _Piece] = {}

    def __bool__(self) -> bool:
        return bool(self.pieces)

    def name(self, fqn_of: Mapping[torch.Tensor, str]) -> None:
        self._by_fqn = {fqn_of[p]: piece for p, piece in self.pieces.items() if p in fqn_of}

    def shard_counts(self) -> dict[torch.Tensor, int]:
        """Each FSDP1 parameter's shard group size (for the norm)."""
        return {p: piece.unit.group.size() for p, piece in self.pieces.items()}

    def _piece_of(self, key: str) -> tuple[_Piece, str] | None:
        """The FSDP1 piece a flat `<kind>.<fqn>[.<name>]` key is about, and the key sans FQN."""
        kind, _, rest = key.partition(".")
        if kind == "param_groups" or not self._by_fqn:
            return None
        parts = rest.split(".")
        for cut in range(len(parts), 0, -1):
            piece = self._by_fqn.get(".".join(parts[:cut]))
            if piece is not None:
                return piece, ".".join([kind, *parts[cut:]])
        return None

    @torch.no_grad()
    def export(self, flat: dict[str, Any]) -> dict[str, Any]:
        """`flat` with FSDP1 entries as FSDP2 writes them; every rank must call it."""
        elements: dict[tuple[_Unit, str, torch.dtype], list[tuple[str, _Piece, torch.Tensor]]] = {}
        scalars: dict[tuple[_Unit, torch.dtype], list[tuple[str, _Piece, torch.Tensor]]] = {}
        for key, value in flat.items():
            found = self._piece_of(key)
            if found is None:
                continue
            piece, kind = found
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"{key} = {value!r}: FSDP1 state must be tensors")
            if value.dim() == 0:
                scalars.setdefault((piece.unit, value.dtype), []).append((key, piece, value))
            elif value.dim() == 1 and value.numel() == piece.numel:
                group_key = (piece.unit, kind, value.dtype)
                elements.setdefault(group_key, []).append((key, piece, value))
            else:
                raise ValueError(
                    f"{key} has shape {tuple(value.shape)}, neither a scalar nor one value per "
                    f"element of this rank's FSDP1 slice ({piece.numel}): an optimizer that is "
                    "not elementwise cannot step FSDP1 parameters; use FSDP2"
                )
        out = dict(flat)
        for (unit, _, dtype), entries in elements.items():
            mine = torch.zeros(unit.shard_numel, dtype=dtype, device=entries[0][2].device)
            for _, piece, value in entries:
                mine[piece.offset : piece.offset + piece.numel] = value
            every = mine.new_empty(unit.shard_numel * unit.group.size())
            dist.all_gather_single(every, mine, group=unit.group)
            for key, piece, _ in entries:
                end = piece.begin + piece.shape.numel()
                whole = every[piece.begin : end].view(piece.shape).clone()
                out[key] = distribute_tensor(whole, unit.mesh, unit.placements, src_data_rank=None)
        for (unit, _), entries in scalars.items():
            me = dist.get_rank(unit.group)
            values = torch.stack(
                [v if piece.owner == me else torch.zeros_like(v) for _, piece, v in entries]
            )
            # One rank adds its value, the others zeros: exact.
            dist.all_reduce(values, group=unit.group)
            for (key, _, _), value in zip(entries, values.unbind()):
                out[key] = value.clone()
        return out

    @torch.no_grad()
    def take_local(self, flat: dict[str, Any]) -> tuple[dict[str, Any], set[str], set[str]]:
        """`flat` with full-shape FSDP1 entries cut to this rank's slice, the keys cut, and those
        all zeros (a placeholder the slice alone cannot tell)."""
        out = dict(flat)
        sliced, zeros = set(), set()
        for key, value in flat.items():
            found = self._piece_of(key)
            if found is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            piece = found[0]
            if tuple(value.shape) != tuple(piece.shape):
                continue
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            out[key] = whole.reshape(-1)[piece.start : piece.start + piece.numel].clone()
            sliced.add(key)
            if not whole.ne(0).any():
                zeros.add(key)
        return out, sliced, zeros


def refuse_optimizers(classes: Iterable[type[Optimizer] | None]) -> None:
    for cls in classes:
        if cls is not None and not issubclass(cls, ELEMENTWISE):
            raise ValueError(
                f"{cls.__name__} on FSDP1 parameters: FSDP1 hands the optimizer a 1-D slice of "
                f"each parameter, cut anywhere, and {cls.__name__} does not update elementwise "
                "(it would compute another update on a piece of a matrix); shard with FSDP2 "
                "([parallelism] data_parallel_shard_impl = 'fsdp2'), or use one of "
                f"{', '.join(c.__name__ for c in ELEMENTWISE)}"
            )


def refuse_coded(settings: Iterable[Mapping[str, Any] | None]) -> None:
    for kwargs in settings:
        if kwargs and (name := kwargs.get("moment_dtype")) in CODED:
            raise ValueError(
                f"moment_dtype = {name!r} on FSDP1 parameters: the codes' blocks are elements "
                "of a parameter's row, and FSDP1 hands the optimizer 1-D slices cut anywhere; "
                "shard with FSDP2 ([parallelism] data_parallel_shard_impl = 'fsdp2') or keep "
                "moment_dtype = 'bfloat16'"
            )
