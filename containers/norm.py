"""The global L2 norm over the job's mesh, each element counted once (ARCHITECTURE.md), and
the non-finite checks a step without a clip takes. Dividing each piece's squares by its copies
rather than electing an owner keeps a non-finite gradient anywhere in every rank's sum."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from containers.tensors import dense, local, scratch, scratch_numel

__all__ = [
    "GlobalNorm",
    "all_finite",
    "clip_grads",
    "nonfinite_flag",
    "sum_of_squares",
]


def _shards(t: DTensor) -> int:
    """Product of the sizes of the mesh dims `t` is sharded on."""
    n = 1
    for dim, placement in enumerate(t.placements):
        if placement.is_partial():
            raise ValueError(
                f"a gradient placed {t.placements} on {t.device_mesh}: a Partial gradient "
                "has no norm until it is reduced; redistribute it to Shard or Replicate first"
            )
        # Not `is_shard()`: FSDP2 over TP places `_StridedShard`, which is not a Shard.
        if not placement.is_replicate():
            n *= t.device_mesh.size(dim)
    return n


class GlobalNorm:
    """How one rank's gradients add up to the job's global L2 norm over `mesh` (None: one
    stage over the world). `shards`: FSDP1 slices -> how many pieces (pass `params=`)."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        mesh: DeviceMesh | None = None,
        shards: Mapping[torch.Tensor, int] | None = None,
    ) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        pp = 1
        if mesh is not None:
            if mesh.size() != world:
                raise ValueError(
                    f"mesh {mesh} holds {mesh.size()} ranks but the world has {world}: pass "
                    "the job's mesh over every rank (dims pp, dp_replicate, dp_shard, tp)"
                )
            if "pp" in (mesh.mesh_dim_names or ()):
                pp = mesh["pp"].size()
        self.ranks_per_stage = world // pp
        # With a job mesh the ranks always agree on the norm (replicas that drifted apart
        # count by their mean square); without one, plain tensors stay local, as in torch.
        self.shards = dict(shards or {})
        sharded = bool(self.shards) or any(isinstance(p, DTensor) for p in params)
        self.collective = world > 1 and (mesh is not None or sharded)
        self.device = next((p.device for p in params), torch.device("cpu"))
        for p in params:
            if isinstance(p, DTensor) and self.ranks_per_stage % _shards(p):
                raise ValueError(
                    f"a parameter is sharded {_shards(p)} ways on {p.device_mesh}, which does "
                    f"not divide the {self.ranks_per_stage} ranks of a pipeline stage: shard "
                    "parameters on sub-meshes of the job's mesh without its pp dim"
                )
        for n in self.shards.values():
            if self.ranks_per_stage % n:
                raise ValueError(
                    f"an FSDP1 parameter is sharded over {n} ranks, which does not divide the "
                    f"{self.ranks_per_stage} ranks of a pipeline stage: shard over the job's "
                    "data-parallel ranks"
                )

    def copies(self, grad: torch.Tensor, param: torch.Tensor | None = None) -> int:
        """How many ranks hold an identical copy of this rank's piece of `grad`."""
        if not self.collective:
            return 1
        if param is not None and param in self.shards:
            return self.ranks_per_stage // self.shards[param]
        if isinstance(grad, DTensor):
            return self.ranks_per_stage // _shards(grad)
        return self.ranks_per_stage

    @torch.no_grad()
    def __call__(
        self,
        grads: Sequence[torch.Tensor],
        params: Sequence[torch.Tensor] | None = None,
        exact: bool = False,
    ) -> torch.Tensor:
        """The global norm of this rank's `grads` (fp32; `exact`: fp64); every rank calls it."""
        by_copies: dict[int, list[torch.Tensor]] = {}
        if not self.collective:  # every piece counts once (the common one-process case: fast)
            if grads:
                by_copies[1] = [dense(local(g)) for g in grads]
        else:
            owners = params if params is not None else [None] * len(grads)
            for g, p in zip(grads, owners, strict=True):
                by_copies.setdefault(self.copies(g, p), []).append(dense(local(g)))
        dtype = torch.float64 if exact else torch.float32
        total = torch.zeros((), dtype=dtype, device=self.device)
        for n, tensors in sorted(by_copies.items()):
            sq = sum_of_squares(tensors, self.device, exact)
            total = total + (sq / n if n > 1 else sq)
        if self.collective:
            dist.all_reduce(total)
        return total.sqrt()


@torch.no_grad()
def clip_grads(
    params: Sequence[torch.Tensor], grad_norm: torch.Tensor, max_norm: float | None
) -> None:
    """Clip `params`' gradients of norm `grad_norm` to `max_norm`, as torch."""
    if not max_norm:
        return
    # A foreach multiply cannot mix DTensors of different meshes (TP x FSDP2 leaves e.g.
    # norm weights on the dp mesh alone).
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, grad_norm)


def sum_of_squares(
    tensors: Sequence[torch.Tensor], device: torch.device, exact: bool = False
) -> torch.Tensor:
    """Sum of squares as an fp32 (`exact`: fp64) scalar, without an fp32 copy."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    sums = []
    for (_, dtype), group in by_kind.items():
        if exact:
            norms = torch._foreach_norm(group, 2, dtype=torch.float64)
            sums.append(torch.stack(norms).square().sum().to(device))
        elif dtype in (torch.float32, torch.float64):
            norms = torch._foreach_norm(group)  # one kernel per list, as torch's own norm
            sums.append(torch.stack(norms).float().square().sum().to(device))
        else:
            sums.append(torch.stack(_low_precision_square_sums(group)).sum().to(device))
    if not sums:
        return torch.zeros((), dtype=torch.float64 if exact else torch.float32, device=device)
    return torch.stack(sums).sum() if len(sums) > 1 else sums[0]


def _low_precision_square_sums(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 sums of squares of low-precision tensors via scratch and `dot` (fast)."""
    norms: list[torch.Tensor] = []
    piece: list[torch.Tensor] = []
    size = 0
    kept = scratch_numel(tensors[0].device)
    flat = (t.reshape(-1) for t in tensors)
    cuts = (f[lo : lo + kept] for f in flat for lo in range(0, f.numel(), kept))
    for t in [*cuts, None]:
        if piece and (t is None or size + t.numel() > kept):
            buffer = scratch(piece[0].device, size)
            views = list(torch.split(buffer, [x.numel() for x in piece]))
            torch._foreach_copy_(views, piece)
            norms.append(torch.dot(buffer, buffer))
            piece, size = [], 0
        if t is not None:
            piece.append(t)
            size += t.numel()
    return norms


@torch.no_grad()
def all_finite(
    tensors: Sequence[torch.Tensor], groups: Sequence[dist.ProcessGroup | None] | None = None
) -> bool:
    """Every element of `tensors` is finite, agreed across `groups` (default: the DTensors'
    mesh). An fp32 sum is non-finite iff an element is or it overflowed; an fp64 sum tells."""
    pieces, groups, device = _local_pieces(tensors, groups)
    mixed = len({t.device for t in pieces}) > 1
    # Every rank takes part, an empty shard too: the decision must be the same everywhere.
    for wide in (False, True):
        sums = [t.sum(dtype=torch.float64) if wide else _sum32(t) for t in pieces]
        if mixed:
            sums = [x.to(device) for x in sums]
        total = torch.stack(sums).sum() if sums else torch.zeros((), device=device)
        if not groups:
            if total.isfinite():
                return True
            continue
        found = (~total.isfinite()).float()
        for group in groups:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        if not found:
            return True
    return False


# The gradient dtypes torch's AMP check takes on CUDA (its kernel: floating types and half).
_AMP_CHECKED = frozenset({torch.float32, torch.float16, torch.float64})


@torch.no_grad()
def nonfinite_flag(
    tensors: Sequence[torch.Tensor],
    groups: Sequence[dist.ProcessGroup | None] | None = None,
    on_host: bool | None = None,
) -> torch.Tensor:
    """The fp32 `found_inf` flag torch's fused kernels read (1.0: an element is not finite),
    agreed across `groups`. On CUDA without a host sync: torch's AMP check (scale 1; bf16: an
    fp64 sum of squares). Elsewhere that check writes every tensor back and a sync is free, so
    `all_finite` decides (`on_host`; None: everywhere but CUDA)."""
    pieces, groups, device = _local_pieces(tensors, groups)
    if on_host is None:
        on_host = device.type != "cuda"
    if on_host or len({t.device for t in pieces}) > 1:
        return torch.tensor(float(not all_finite(tensors, groups)), device=device)
    found = torch.zeros((), device=device)
    checked = [t for t in pieces if t.dtype in _AMP_CHECKED]
    if checked:
        torch._amp_foreach_non_finite_check_and_unscale_(checked, found, torch.ones_like(found))
    if len(checked) < len(pieces):
        # CUDA's AMP check refuses bf16: fp64 squares are finite iff every element is.
        rest = [t for t in pieces if t.dtype not in _AMP_CHECKED]
        found = found.maximum((~sum_of_squares(rest, device, exact=True).isfinite()).float())
    for group in groups:
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return found


def _local_pieces(
    tensors: Sequence[torch.Tensor], groups: Sequence[dist.ProcessGroup | None] | None
) -> tuple[list[torch.Tensor], Sequence[dist.ProcessGroup | None], torch.device]:
    """Local dense tensors, the groups and the device to agree on."""
    pieces, mesh = [], None
    for t in tensors:  # runs every step over every gradient: kept lean
        if isinstance(t, DTensor):
            mesh, t = t.device_mesh, t.to_local()
        pieces.append(dense(t))
    if groups is None:
        groups = [mesh.get_group(d) for d in range(mesh.ndim)] if mesh is not None else []
    device = pieces[0].device if pieces else torch.device(mesh.device_type if mesh else "cpu")
    return pieces, groups, device


def _sum32(t: torch.Tensor) -> torch.Tensor:
    """Sum of `t` in at least fp32 (`dtype=` only where needed: it is slower on CPU)."""
    return t.sum() if t.dtype in (torch.float32, torch.float64) else t.sum(dtype=torch.float32)
