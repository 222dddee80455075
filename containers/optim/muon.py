"""`ShardedMuon`: torch's Muon with Newton-Schulz on whole matrices of sharded parameters.

Newton-Schulz mixes every element of a matrix, so it cannot run on a shard, and torch's Muon
on DTensors makes every rank orthogonalize every matrix. Here momentum stays on the shards;
one all-to-all sends shards to each matrix's owner, each rank orthogonalizes the ones it owns
(~1/W of the work), and a second all-to-all returns them. Shard, `_StridedShard` and
Replicate placements work; who holds which rows and columns is agreed once.

A 3-D parameter is a stack of matrices (MoE experts, `[E, dim, hidden]`): each is
orthogonalized on its own (as torchtitan's DistMuon), its lr adjusted by the matrix shape.
Sharded on dim 0 only (expert parallelism), a rank holds whole matrices and exchanges nothing;
otherwise each expert's matrix is one matrix of the exchange.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from containers.optim.lean import load_keeping_dtypes, moment_dtype_of
from containers.tensors import local
from containers.update.forms import check_moment_dtype

__all__ = ["ShardedMuon", "newton_schulz"]


def newton_schulz(
    update: torch.Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The orthogonalized `update` in `dtype`, bitwise as torch's Muon in bf16."""
    a, b, c = coefficients
    x = update.to(dtype, copy=True)
    wide = update.size(0) > update.size(1)
    if wide:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if wide else x


def _orthogonal(update: torch.Tensor, ns: tuple[Any, ...]) -> torch.Tensor:
    """`newton_schulz` of a matrix, or of each matrix of a 3-D stack."""
    if update.dim() == 2:
        return newton_schulz(update, *ns)
    return torch.stack([newton_schulz(u, *ns) for u in update]) if len(update) else update


def _ns_dtype(name: str, param: torch.Tensor | None) -> torch.dtype:
    if name == "auto":
        on_cuda = param is not None and local(param).device.type == "cuda"
        return torch.bfloat16 if on_cuda else torch.float32
    return getattr(torch, name)


def _sharded_dims(t: DTensor) -> tuple[int, ...]:
    """Mesh dims that split `t` (over more than one rank)."""
    mesh = t.device_mesh
    return tuple(
        i for i, p in enumerate(t.placements) if not isinstance(p, Replicate) and mesh.size(i) > 1
    )


def _cuts_matrices(t: torch.Tensor) -> bool:
    """Whether a rank holds part of a matrix of `t` (a 3-D one split on dim 0 only does not)."""
    if not isinstance(t, DTensor):
        return False
    dims = _sharded_dims(t)
    return any(t.ndim == 2 or getattr(t.placements[d], "dim", 0) != 0 for d in dims)


def _held(t: DTensor) -> tuple[torch.Tensor, ...]:
    """The global indices of each dim whose cross product is this rank's shard (no
    communication)."""
    held = []
    for dim, size in enumerate(t.shape):
        placements = []
        for p in t.placements:
            if isinstance(p, _StridedShard) and p.dim == dim:
                placements.append(_StridedShard(0, split_factor=p.split_factor))
            elif isinstance(p, Shard) and p.dim == dim:
                placements.append(Shard(0))
            else:
                placements.append(Replicate())
        index = torch.arange(size, device=t.device_mesh.device_type)
        held.append(distribute_tensor(index, t.device_mesh, placements, src_data_rank=None))
    return tuple(h.to_local() for h in held)


@dataclass
class _Exchange:
    """How one group of ranks passes the shards of its matrices to their owners and back."""

    group: dist.ProcessGroup
    rank: int
    shapes: list[torch.Size]  # by matrix
    owner: list[int]  # by matrix
    blocks: list[list[tuple[torch.Tensor, torch.Tensor]]]  # by matrix, by rank: rows, cols
    index: list[list[tuple[Any, Any]]]  # by matrix, by rank: the block's index into the matrix
    experts: list[list[int] | None]  # by parameter: the experts this rank holds (3-D ones)

    @cached_property
    def owned(self) -> list[list[int]]:
        """The matrices each rank owns, by rank."""
        return [[m for m, r in enumerate(self.owner) if r == rank] for rank in range(self.world)]

    @cached_property
    def split(self) -> int:
        """The most elements one rank sends to one owner: every all-to-all split is this."""
        return max(
            sum(self.numel(m, sender) for m in mine)
            for mine in self.owned
            for sender in range(self.world)
        )

    @property
    def world(self) -> int:
        return len(self.blocks[0])

    def numel(self, matrix: int, rank: int) -> int:
        rows, cols = self.blocks[matrix][rank]
        return len(rows) * len(cols)


def _owners(shapes: Sequence[torch.Size], world: int) -> list[int]:
    """Each matrix's owner: the least loaded rank, largest first (cost ~ numel x min dim)."""
    load = [0] * world
    owner = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-shapes[i].numel(), i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += shapes[i].numel() * min(shapes[i])
    return owner


def _group_of(t: DTensor) -> dist.ProcessGroup:
    dims = _sharded_dims(t)
    mesh = t.device_mesh
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            f"a parameter of shape {tuple(t.shape)} is sharded over mesh dims {dims} of an "
            "unnamed DeviceMesh; name the mesh dims (init_device_mesh(..., mesh_dim_names=...))"
        )
    return mesh[tuple(names[d] for d in dims)]._flatten().get_group()


def _all_to_all(
    chunks: list[torch.Tensor], group: dist.ProcessGroup, sizes: list[int], split: int
) -> list[torch.Tensor]:
    """Send `chunks[r]` to rank r; receive `sizes[r]` elements from each. Splits are padded
    to `split` elements (gloo takes only equal splits)."""
    send = chunks[0].new_zeros(len(chunks) * split)
    for r, chunk in enumerate(chunks):
        send[r * split : r * split + chunk.numel()] = chunk
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return [recv[r * split : r * split + n] for r, n in enumerate(sizes)]


class ShardedMuon(torch.optim.Muon):
    """`torch.optim.Muon` with Newton-Schulz on whole matrices, spread over sharding ranks;
    3-D parameters are stacks of matrices (experts), each orthogonalized on its own.

    State matches torch's Muon (checkpoints move between them). Extra per-group settings:
        ns_dtype: "bfloat16" (torch's), "float32", or "auto": bfloat16 on CUDA, float32 on
            CPU (where bf16 matmuls are much slower without bf16 units).
        moment_dtype: "float32" or "bfloat16" momentum (updated in fp32, rounded to nearest).
    """

    matrix_dims = (2, 3)  # (`containers.state.param_groups.matrix_only`)

    def __init__(
        self, params: Any, *, ns_dtype: str = "auto", moment_dtype: str = "float32", **kwargs: Any
    ) -> None:
        groups = list(params)
        super().__init__([torch.empty(1, 1)], **kwargs)  # torch's checks (it takes 2-D only)
        self.defaults |= {"ns_dtype": ns_dtype, "moment_dtype": moment_dtype}
        self.param_groups = []
        for group in groups if groups and isinstance(groups[0], dict) else [{"params": groups}]:
            self.add_param_group(group)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in self.matrix_dims:
                    raise ValueError(
                        "Muon takes 2-D parameters and 3-D stacks of matrices (one per expert) "
                        f"only; got a parameter of shape {tuple(p.shape)}"
                    )
            check_moment_dtype(group, "ShardedMuon")
            if group["ns_dtype"] not in ("auto", "bfloat16", "float32"):
                raise ValueError(
                    f"ns_dtype = {group['ns_dtype']!r}: use 'auto', 'bfloat16' (torch's Muon) "
                    "or 'float32'"
                )
        self._exchanges: dict[tuple[int, ...], _Exchange] = {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Torch's load, keeping each group's own `moment_dtype`."""
        load_keeping_dtypes(self, state_dict, ("momentum_buffer",), super().load_state_dict)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, updates = [], []
            momentum = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Muon does not support sparse gradients")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    dtype = moment_dtype_of(group) if p.dtype == torch.float32 else p.dtype
                    state["momentum_buffer"] = torch.zeros_like(p.grad, dtype=dtype)
                grad, buf = local(p.grad), local(state["momentum_buffer"])
                # bf16 momentum: updated in fp32 and rounded back, one tensor at a time.
                wide = buf if buf.dtype == grad.dtype else buf.to(grad.dtype)
                wide.lerp_(grad, 1 - momentum)
                if wide is not buf:
                    buf.copy_(wide)
                params.append(p)
                updates.append(grad.lerp(wide, momentum) if group["nesterov"] else wide)
            ortho = self._orthogonalize(params, updates, group)
            lr, decay = group["lr"], group["weight_decay"]
            for p, o in zip(params, ortho):
                alpha = -torch.optim._muon._adjust_lr(lr, group["adjust_lr_fn"], p.shape[-2:])
                local(p).mul_(1 - lr * decay).add_(o, alpha=alpha)
        return loss

    def _orthogonalize(
        self, params: list[torch.Tensor], updates: list[torch.Tensor], group: dict[str, Any]
    ) -> list[torch.Tensor]:
        """The local block of each orthogonalized update."""
        dtype = _ns_dtype(group["ns_dtype"], params[0] if params else None)
        ns = (group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
        out: list[torch.Tensor | None] = [None] * len(params)
        batches: dict[tuple[Any, ...], list[int]] = {}
        for i, p in enumerate(params):
            if _cuts_matrices(p):
                batches.setdefault((id(p.device_mesh), _sharded_dims(p)), []).append(i)
            else:
                out[i] = _orthogonal(updates[i], ns)
        for idx in batches.values():
            ex = self._exchange([params[i] for i in idx])
            matrices = []  # this rank's block of each matrix (an expert's: empty if not held)
            for i, experts in zip(idx, ex.experts):
                u = updates[i]
                at = {e: j for j, e in enumerate(experts or ())}
                empty = u.new_empty(0, 0)
                rest = [u[at[e]] if e in at else empty for e in range(params[i].shape[0])]
                matrices += [u] if experts is None else rest
            results = iter(self._spread(matrices, ex, ns))
            for i, experts in zip(idx, ex.experts):
                if experts is None:
                    out[i] = next(results)
                    continue
                mine = [next(results) for _ in range(params[i].shape[0])]
                out[i] = torch.stack([mine[e] for e in experts]) if experts else updates[i]
        return out  # type: ignore[return-value]

    def _exchange(self, params: list[DTensor]) -> _Exchange:
        """Who owns which matrix and which block every rank holds; agreed once, then cached."""
        key = tuple(id(p) for p in params)
        if key not in self._exchanges:
            group = _group_of(params[0])
            world = dist.get_world_size(group)
            mine = [tuple(i.cpu() for i in _held(p)) for p in params]
            everyone: list[Any] = [None] * world
            dist.all_gather_object(everyone, mine, group=group)
            device = local(params[0]).device
            me, shapes, blocks, experts = dist.get_rank(group), [], [], []
            for k, p in enumerate(params):
                held = [[i.to(device) for i in everyone[r][k]] for r in range(world)]
                experts.append(held[me][0].tolist() if p.ndim == 3 else None)
                for e in range(p.shape[0]) if p.ndim == 3 else (None,):
                    shapes.append(p.shape[-2:])
                    blocks.append([_block(h, e) for h in held])
            index = [[_cross(*block) for block in by_rank] for by_rank in blocks]
            self._exchanges[key] = _Exchange(
                group, me, shapes, _owners(shapes, world), blocks, index, experts
            )
        return self._exchanges[key]

    def _spread(
        self, updates: list[torch.Tensor], ex: _Exchange, ns: tuple[Any, ...]
    ) -> list[torch.Tensor]:
        """Each update's local block, orthogonalized as a whole matrix by its owner."""
        world, me, split, like = ex.world, ex.rank, ex.split, updates[0]
        mine = ex.owned[me]
        to_owners = [_flat([updates[m] for m in ms], like, like.dtype) for ms in ex.owned]
        sizes = [sum(ex.numel(m, r) for m in mine) for r in range(world)]
        received = _all_to_all(to_owners, ex.group, sizes, split)
        from_rank = [received[r].split([ex.numel(m, r) for m in mine]) for r in range(world)]
        results = []
        for j, m in enumerate(mine):
            full = like.new_empty(ex.shapes[m])
            for r, (rows, cols) in enumerate(ex.blocks[m]):
                full[ex.index[m][r]] = from_rank[r][j].view(len(rows), len(cols))
            results.append(newton_schulz(full, *ns))
        to_holders = [
            _flat([o[ex.index[m][r]] for o, m in zip(results, mine)], like, ns[3])
            for r in range(world)
        ]
        sizes = [sum(ex.numel(m, me) for m in ms) for ms in ex.owned]
        returned = _all_to_all(to_holders, ex.group, sizes, split)
        out: list[torch.Tensor] = [like] * len(updates)
        for r, ms in enumerate(ex.owned):
            for m, block in zip(ms, returned[r].split([ex.numel(m, me) for m in ms])):
                rows, cols = ex.blocks[m][me]
                out[m] = block.view(len(rows), len(cols))
        return out


def _block(held: list[torch.Tensor], expert: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows and columns of a matrix (or of `expert`'s) that a rank holding `held` has."""
    if expert is None:
        return held[0], held[1]
    if expert in held[0]:
        return held[1], held[2]
    return held[1][:0], held[2][:0]


def _cross(rows: torch.Tensor, cols: torch.Tensor) -> tuple[Any, Any]:
    """Index of the block `rows` x `cols`: slices for ranges (views), else index tensors."""
    r, c = _as_slice(rows), _as_slice(cols)
    if r is None and c is None:
        return rows[:, None], cols[None, :]
    return (rows if r is None else r), (cols if c is None else c)


def _as_slice(index: torch.Tensor) -> slice | None:
    start = int(index[0]) if len(index) else 0
    if torch.equal(index.cpu(), torch.arange(start, start + len(index))):
        return slice(start, start + len(index))
    return None


def _flat(tensors: list[torch.Tensor], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensors` flattened into one, in `dtype` on `like`'s device (empty if there are none)."""
    if not tensors:
        return like.new_empty(0, dtype=dtype)
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])
