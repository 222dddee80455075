"""Shard model parts with FSDP2 (or FSDP1) over the data-parallel dims of the job's mesh,
whatever the model family."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    FullyShardedDataParallel,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp.wrap import CustomPolicy
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor

from config import ShardImpl
from config import Training as TrainingConfig

__all__ = [
    "data_parallel_mesh",
    "mixed_precision_policy",
    "replicate_rest",
    "shard_parts",
    "stage_group",
    "sub_mesh",
]


def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for key, param in list(module.named_parameters(recurse=False)):
        if not isinstance(param, DTensor):
            replicated = distribute_tensor(param.detach(), mesh, [Replicate()])
            module.register_parameter(key, nn.Parameter(replicated, param.requires_grad))


def _in_replicated(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _out_local(module: nn.Module, outputs: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


def replicate_rest(part: nn.Module, mesh: DeviceMesh) -> None:
    """Make every parameter of `part` that tensor parallelism left plain a DTensor replicated
    over `mesh` (the tp dim), computing on local tensors as before.

    Every parameter of a part then lives on one mesh, which foreach and fused optimizer kernels
    require, and its placement says that the tp ranks hold copies (the global norm counts
    them once).
    """
    for module in part.modules():
        owns_plain = any(not isinstance(p, DTensor) for p in module.parameters(recurse=False))
        if owns_plain:
            distribute_module(module, mesh, _replicate_params, _in_replicated, _out_local)


def sub_mesh(mesh: DeviceMesh, *names: str) -> DeviceMesh:
    """`mesh[names]`. Under expert parallelism "dp_shard" is flattened from ("dp_shard_mod_ep",
    "ep") (`components.parallel_dims`), and torch notes that slicing a flattened dim out of the
    root mesh may go away; the slice itself is right, so the notice is kept out of the logs."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim", category=UserWarning)
        return mesh[names]


def data_parallel_mesh(mesh: DeviceMesh, shard: str = "dp_shard") -> DeviceMesh | None:
    """The dims FSDP2 shards over: `shard` (dp_shard; for routed experts under expert
    parallelism, dp_shard_mod_ep), with dp_replicate before it for HSDP; None when both have
    size 1 (nothing to shard)."""
    if mesh["dp_replicate"].size() > 1:
        return sub_mesh(mesh, "dp_replicate", shard)
    alone = sub_mesh(mesh, shard)
    return alone if alone.size() > 1 else None


def _fsdp1(part: nn.Module, mesh: DeviceMesh, units: set[nn.Module]) -> nn.Module:
    """`part` wrapped by FSDP1, each of `units` wrapped inside it; HSDP on a 2-D mesh."""
    return FullyShardedDataParallel(
        part,
        auto_wrap_policy=CustomPolicy(lambda module: module in units),
        device_mesh=mesh,
        sharding_strategy=(
            ShardingStrategy.HYBRID_SHARD if mesh.ndim == 2 else ShardingStrategy.FULL_SHARD
        ),
        # Original parameters (FQNs, param groups by name) for the optimizers; FSDP1 needs a
        # device even on CPU.
        use_orig_params=True,
        device_id=torch.device(mesh.device_type),
    )


def mixed_precision_policy(cfg: TrainingConfig) -> MixedPrecisionPolicy | None:
    """FSDP2's policy of `[training] mixed_precision_param` and `mixed_precision_reduce`; None
    when both are float32 (FSDP2's default: no casts)."""
    if cfg.mixed_precision_param == cfg.mixed_precision_reduce == "float32":
        return None
    return MixedPrecisionPolicy(
        param_dtype=getattr(torch, cfg.mixed_precision_param),
        reduce_dtype=getattr(torch, cfg.mixed_precision_reduce),
    )


def shard_parts(
    parts: list[nn.Module],
    mesh: DeviceMesh | None,
    units: Callable[[nn.Module], Iterable[nn.Module]],
    impl: ShardImpl = "fsdp2",
    mp_policy: MixedPrecisionPolicy | None = None,
) -> list[nn.Module]:
    """Shard each unit of each part, then the part itself, over `mesh`'s data-parallel dims
    (`data_parallel_mesh`): `fully_shard` (FSDP2), or FSDP1's `FullyShardedDataParallel`
    (`use_orig_params=True`; FULL_SHARD, or HYBRID_SHARD with a replicate dim).

    Each unit is all-gathered and resharded on its own (e.g. a transformer block), so the
    whole part is never gathered at once; the part's own call picks up what no unit holds.

    Args:
        parts: the model parts, sharded in place.
        mesh: the job's named mesh, or a 1-D data-parallel mesh; None leaves the parts
            unsharded (one process).
        units: a part's modules to shard one by one, in forward order.
        impl: "fsdp2" or "fsdp1".
        mp_policy: FSDP2's mixed precision (`mixed_precision_policy`); None: none.

    Returns:
        FSDP2: `parts` (the same module objects); FSDP1: each part's wrapper.
    """
    if mesh is not None and "dp_replicate" in (mesh.mesh_dim_names or ()):
        mesh = data_parallel_mesh(mesh)
    if mesh is None:
        return parts
    if impl == "fsdp1":
        return [_fsdp1(part, mesh, set(units(part))) for part in parts]
    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    # A unit's inputs come from its part, which computes in param_dtype already; the float
    # inputs a unit-level cast would catch are side inputs that the model keeps at full
    # precision on purpose (the llama rotary table: cast to bf16 it moves every position).
    unit_policy = dataclasses.replace(policy, cast_forward_inputs=False)
    for part in parts:
        for unit in units(part):
            fully_shard(unit, mesh=mesh, mp_policy=unit_policy)
        fully_shard(part, mesh=mesh, mp_policy=policy)
    return parts


def stage_group(mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    """The process group of the ranks of this rank's pipeline stage (those with its pp index),
    e.g. to sum what every rank of a stage saw; None: the world (no pipeline, or one process).

    Every rank creates every stage's group, in the same order, as `new_group` requires.
    """
    if mesh is None or mesh["pp"].size() == 1:
        return None
    groups = [dist.new_group(ranks.flatten().tolist()) for ranks in mesh.mesh]
    return groups[mesh.get_local_rank("pp")]
