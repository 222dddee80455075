"""The global L2 norm of the gradients over the job's mesh, each element counted once; and
the non-finite checks a step without a clip takes instead (`all_finite`, `nonfinite_flag`).

The job's named mesh has the dims ("pp", "dp_replicate", "dp_shard", "tp"). A pipeline rank
holds its stages' parameters; within a stage every parameter lives on all the stage's
`world / pp` ranks, either as a DTensor (FSDP2 over the dp dims, possibly with TP on "tp") or as
a plain tensor. The local shard of a DTensor is held identically by `world / pp / S` ranks,
where S is the product of the sizes of the mesh dims it is sharded on (the dims it is
replicated on, and the stage's dims outside its mesh, copy it); a plain tensor by all
`world / pp`. So each rank adds up its shards' sums of squares, each divided by its number of
copies, and one all-reduce over the world sums shards, replicas (back to one) and stages.
Dividing rather than electing one owner per copy keeps every rank's gradients in the sum, so
a non-finite gradient anywhere makes the norm non-finite on every rank.

FSDP1 parameters (`containers.state.fsdp1`) are plain tensors holding a 1-D slice each: every
element lies on one rank of the shard group, so their copies are `world / pp` over the
group's size (HSDP replicas), told by `shards`.
"""

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
    "exact_sum_of_squares",
    "nonfinite_flag",
    "sum_of_squares",
]


def _shards(t: DTensor) -> int:
    """Into how many distinct pieces `t`'s mesh cuts it: the product of the sizes of the mesh
    dims it is sharded on (Shard or _StridedShard)."""
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
    """How one rank's gradients add up to the job's global L2 norm (built once per container).

    Args:
        params: every parameter whose gradient may be measured (decides, the same way on
            every rank, whether a collective is needed when `mesh` is None).
        mesh: the job's named DeviceMesh (dims pp, dp_replicate, dp_shard, tp); without a
            "pp" dim it is one stage. None: one stage over the world, with a collective only
            if some parameter is a DTensor or in `shards`.
        shards: plain parameters that hold disjoint pieces (FSDP1 slices) -> into how many
            pieces they are cut; their gradients must be passed with `params=`.
    """

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
        device = next((p.device for p in params), None)
        self.device = device if device is not None else torch.device("cpu")
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
        """How many ranks of the world hold an identical copy of this rank's piece of `grad`
        (the gradient of `param`, if given)."""
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
        """The global norm (fp32 scalar) of `grads`, this rank's gradients; inf or nan if any
        gradient on any rank is, or if a sum of squares overflowed fp32 (elements beyond
        ~1.8e19). Every rank must call it (one all-reduce when needed).

        `params`: the parameters whose gradients `grads` are, in order (needed for `shards`).
        `exact`: sum in fp64 (an fp64 scalar), where squares of finite fp32 values cannot
        overflow: inf or nan only if a gradient is. A second read, for the rare step whose
        fp32 norm was not finite.
        """
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
            if exact:
                sq = exact_sum_of_squares(tensors, self.device)
            else:
                sq = sum_of_squares(tensors, self.device)
            total = total + (sq / n if n > 1 else sq)
        if self.collective:
            dist.all_reduce(total)
        return total.sqrt()


@torch.no_grad()
def clip_grads(
    params: Sequence[torch.Tensor], grad_norm: torch.Tensor, max_norm: float | None
) -> None:
    """Scale the gradients of `params` so their norm `grad_norm` is at most `max_norm` (0 or
    None: leave them); torch's own clip, so results match `clip_grad_norm_`."""
    if not max_norm:
        return
    # One call per mesh: a foreach multiply cannot mix DTensors of different meshes
    # (TP x FSDP2 leaves FSDP-only parameters, e.g. norms, on the dp mesh alone).
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, grad_norm)


def sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of squares of `tensors`' elements as an fp32 scalar on `device`, accumulated in
    fp32 without an fp32 copy of any tensor."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    sums = []
    for (_, dtype), group in by_kind.items():
        if dtype in (torch.float32, torch.float64):
            norms = torch._foreach_norm(group)  # one kernel per list, as torch's own norm
            sums.append(torch.stack(norms).float().square().sum().to(device))
        else:
            sums.append(torch.stack(_low_precision_square_sums(group)).sum().to(device))
    return torch.stack(sums).sum() if len(sums) > 1 else sums[0]


def exact_sum_of_squares(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of squares of `tensors`' elements in fp64 (on `device`): finite for any finite
    fp32/bf16/fp16 values (their squares are below 1.2e77), so non-finite only if an element
    is. One multi-tensor kernel per device and dtype on CUDA (each element widened to fp64
    before it is squared: torch's `_foreach_norm` with `dtype`), a norm per tensor elsewhere."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    sums = [
        torch.stack(torch._foreach_norm(group, 2, dtype=torch.float64)).square().sum().to(device)
        for group in by_kind.values()
    ]
    if not sums:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(sums).sum() if len(sums) > 1 else sums[0]


def _low_precision_square_sums(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 sums of squares of pieces of low-precision tensors (they add up to the tensors'):
    each piece converted into the scratch buffer with one foreach copy and measured with one
    `dot` of it with itself (BLAS: 2.4x faster than `vector_norm` on a CPU), rather than by
    `vector_norm(dtype=)`, which allocates an fp32 copy of each tensor, or one norm per tensor,
    which costs a kernel call per tensor."""
    norms: list[torch.Tensor] = []
    piece: list[torch.Tensor] = []
    size = 0
    if not tensors:
        return norms
    # A tensor larger than the kept buffer goes in pieces of it: a larger buffer is a new
    # allocation, on a CPU page-faulted in at every step (4 x 16 MiB: 19 ms of a 37 ms step).
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
    """Whether every element of `tensors` is finite, agreed across `groups` (default: every
    dimension of the DTensors' mesh, so each rank holding a shard decides the same).

    One read of each tensor and no write: the sum of a tensor's elements (accumulated in
    fp32) is non-finite iff an element is, or a partial sum overflowed fp32 (elements near
    its limit); only then a sum in fp64, where finite values cannot overflow, tells the two
    apart. A sum, not a norm: it skips the multiply, and measured 0.7-0.8 of `_foreach_norm`'s
    time on a CPU (benchmarks/README.md). One collective per group and one host sync, twice
    in that rare case.
    """
    return _finite(*_local_pieces(tensors, groups))


def _finite(
    pieces: list[torch.Tensor], groups: Sequence[dist.ProcessGroup | None], device: torch.device
) -> bool:
    """`all_finite` over local pieces (`_local_pieces`)."""
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
    """1.0 if an element of `tensors` is not finite, else 0.0, agreed across `groups` (as
    `all_finite`): an fp32 scalar on their device, the `found_inf` that torch's fused Adam
    kernels read to leave everything as it was.

    On CUDA the host never waits for it: torch's AMP check (`GradScaler`'s, with a scale of
    1, which leaves every value as it was) sets the flag from a multi-tensor kernel, exact
    (no overflow to tell apart; bf16 gradients, which it refuses there, by their fp64 sum of
    squares), and the agreement is a device collective. Measured on an
    H200 (benchmarks/README.md) against the read-only `_foreach_norm` of order inf: as fast
    at 8 parts, at 32 parts half its time (one output, not one tensor per gradient).
    Elsewhere that check loops over the tensors and writes each back, and waiting costs
    nothing: `all_finite` decides there (`on_host`; None: everywhere but on CUDA).
    """
    pieces, groups, device = _local_pieces(tensors, groups)
    if on_host is None:
        on_host = device.type != "cuda"
    if on_host or len({t.device for t in pieces}) > 1:
        return torch.tensor(float(not _finite(pieces, groups, device)), device=device)
    found = torch.zeros((), device=device)
    checked = [t for t in pieces if t.dtype in _AMP_CHECKED]
    if checked:
        torch._amp_foreach_non_finite_check_and_unscale_(checked, found, torch.ones_like(found))
    if len(checked) < len(pieces):
        # CUDA's AMP check refuses bf16 ("not implemented for 'BFloat16'", seen on an H100):
        # their squares summed in fp64, finite iff every element is.
        rest = [t for t in pieces if t.dtype not in _AMP_CHECKED]
        found = found.maximum((~exact_sum_of_squares(rest, device).isfinite()).float())
    for group in groups:
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return found


def _local_pieces(
    tensors: Sequence[torch.Tensor], groups: Sequence[dist.ProcessGroup | None] | None
) -> tuple[list[torch.Tensor], Sequence[dist.ProcessGroup | None], torch.device]:
    """The local tensors of `tensors` (DTensors' shards, sparse ones' values), the groups to
    agree over (default: every dimension of the DTensors' mesh) and the device to agree on."""
    pieces, mesh = [], None
    for t in tensors:  # runs every step over every gradient: kept lean
        if isinstance(t, DTensor):
            mesh, t = t.device_mesh, t.to_local()
        pieces.append(t.coalesce().values() if t.is_sparse else t)
    if groups is None:
        groups = [mesh.get_group(d) for d in range(mesh.ndim)] if mesh is not None else []
    device = pieces[0].device if pieces else torch.device(mesh.device_type if mesh else "cpu")
    return pieces, groups, device


def _sum32(t: torch.Tensor) -> torch.Tensor:
    """The sum of `t` accumulated in (at least) fp32; `dtype=` only where it changes the
    result: on an fp32 tensor it costs 15% more on a CPU for the same sum."""
    return t.sum() if t.dtype in (torch.float32, torch.float64) else t.sum(dtype=torch.float32)
