"""How the moe family is cut into model parts, split over expert-parallel ranks and sharded.

As torchtitan does: the routed experts of each block are split on their first dim (the expert
dim) over the mesh's ep ranks, then FSDP2-sharded over the data-parallel ranks outside ep
(dp_shard_mod_ep, with dp_replicate for HSDP) as a unit of their own, their gradients divided
by every data-parallel rank (as the dense ones are: a mean over the whole batch); every other
parameter (attention, router, shared expert, norms, embedding, head) is sharded over dp_shard
as llama's are. Without expert parallelism the experts are sharded like any weight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from components.models.llama.model import split_model
from components.models.moe.model import MoE, Transformer
from components.parallelize import data_parallel_mesh, shard_parts, sub_mesh
from config import Model as ModelConfig
from config import ShardImpl

__all__ = ["parallelize"]


def _blocks(part: nn.Module) -> Iterable[nn.Module]:
    return part.get_submodule("layers").children()


def _split_experts(moe: MoE, mesh: DeviceMesh) -> None:
    """`moe`'s experts as DTensors split on the expert dim over the ep ranks of `mesh`, its
    tokens routed to them by all-to-all."""
    ep = sub_mesh(mesh, "ep")
    for name, param in list(moe.experts.named_parameters(recurse=False)):
        split = distribute_tensor(param.detach(), ep, [Shard(0)])
        moe.experts.register_parameter(name, nn.Parameter(split, param.requires_grad))
    moe.ep_group = ep.get_group()


def _shard_experts(
    moe: MoE, mesh: DeviceMesh, dims: int, mp_policy: MixedPrecisionPolicy | None
) -> None:
    """FSDP2 over the data-parallel ranks outside ep, the gradients divided by all `dims`
    data-parallel ranks."""
    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    outside = data_parallel_mesh(mesh, "dp_shard_mod_ep")
    if outside is None:  # every data-parallel rank is an ep rank: a mesh of one
        outside = sub_mesh(mesh, "dp_shard_mod_ep")
    fully_shard(
        moe.experts, mesh=outside, mp_policy=dataclasses.replace(policy, cast_forward_inputs=False)
    )
    moe.experts.set_gradient_divide_factor(float(dims))
    if sub_mesh(mesh, "dp_shard_mod_ep").size() > 1:
        # Sum, then divide: gloo has no pre-multiplied sum. Not over one rank, where FSDP2
        # divides as it copies (torch 2.13), and would divide a second time after the sum.
        moe.experts.set_force_sum_reduction_for_comms(True)


def parallelize(
    model: nn.Module,
    cfg: ModelConfig,
    mesh: DeviceMesh | None,
    stages: Sequence[int],
    /,
    *,
    shard_impl: ShardImpl = "fsdp2",
    mp_policy: MixedPrecisionPolicy | None = None,
) -> list[nn.Module]:
    """This rank's model parts: `model` split into `[model] num_parts` (llama's split: the
    FQNs kept), the parts `stages` kept; experts split over the mesh's ep dim if it has one,
    then each block and part sharded over its data-parallel dims.

    Args:
        model: the whole moe `Transformer`.
        cfg: the `[model]` section (reads `num_parts`).
        mesh: the job's named mesh (`components.parallel_dims`: with an "ep" dim under expert
            parallelism); None: one process.
        stages: indices of the parts this rank holds (all of them without pipelining).
        shard_impl: "fsdp2" (`fully_shard`) or "fsdp1" (without expert parallelism).
        mp_policy: FSDP2's mixed precision for every `fully_shard` (None: none).
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"moe parallelize: expected a moe Transformer, got {type(model)}")
    parts: list[nn.Module] = [
        part for i, part in enumerate(split_model(model, cfg.num_parts)) if i in stages
    ]
    if mesh is not None and "ep" in (mesh.mesh_dim_names or ()):
        dims = sub_mesh(mesh, "dp_replicate", "dp_shard").size()
        for part in parts:
            for moe in (m for m in part.modules() if isinstance(m, MoE)):
                _split_experts(moe, mesh)
                _shard_experts(moe, mesh, dims, mp_policy)
    return shard_parts(parts, mesh, _blocks, shard_impl, mp_policy)
