"""FSDP2 sharding of model parts: the generic `shard_parts` and the llama family's parallelize."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from components.models.llama.model import FLAVORS, Transformer, split_model
from components.models.llama.parallelize import parallelize
from components.parallel_dims import ParallelDims
from components.parallelize import shard_parts
from config import Model as ModelConfig
from tests.harness.dist import run_ranks
from tests.harness.helpers import forward, three_parts


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def _sharding(parts: list[nn.Module]) -> list[dict]:
    """Per part: its parameters' FQNs with placements and mesh, and which modules are FSDP."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    out = []
    for part in parts:
        params = {}
        for name, p in part.named_parameters():
            if isinstance(p, DTensor):
                on_mesh = p.device_mesh.size() == world and p.device_mesh.ndim == 1
                params[name] = (tuple(p.placements), on_mesh)
            else:
                params[name] = None
        fsdp = sorted(name for name, m in part.named_modules() if isinstance(m, FSDPModule))
        out.append({"params": params, "fsdp": fsdp})
    return out


def _llama_on_ranks() -> dict:
    torch.manual_seed(0)
    model = Transformer(FLAVORS["tiny"])
    reference = split_model(copy.deepcopy(model), 2)
    mesh = ParallelDims(1, 1, dist.get_world_size(), 1).build_mesh("cpu")
    parts = parallelize(model, ModelConfig(flavor="tiny", num_parts=2), mesh, [0, 1])
    # Read before the forward: FSDP2 leaves a root module's parameters unsharded after it.
    sharding = _sharding(parts)
    full = {n: p.full_tensor() for part in parts for n, p in part.named_parameters()}
    ref = {n: p.detach() for part in reference for n, p in part.named_parameters()}
    with torch.no_grad():
        logits, expected = forward(parts, _tokens()), forward(reference, _tokens())
    return {
        "same_objects": all(isinstance(p, Transformer) for p in parts),
        "sharding": sharding,
        "reference_fqns": [[n for n, _ in part.named_parameters()] for part in reference],
        "blocks": [[f"layers.{k}" for k in part.layers] for part in reference],
        "params_equal": full.keys() == ref.keys()
        and all(torch.equal(full[n], ref[n]) for n in ref),
        "logits": logits,
        "expected": expected,
    }


def test_llama_parts_are_sharded_block_by_block_over_two_ranks():
    """Every block and part is an FSDPModule; every parameter a Shard(0) DTensor on the mesh
    under its unsharded FQN; values and forward match the unsharded parts."""
    for r in run_ranks(2, _llama_on_ranks):
        assert r["same_objects"] and len(r["sharding"]) == 2
        for sharding, fqns, blocks in zip(r["sharding"], r["reference_fqns"], r["blocks"]):
            assert list(sharding["params"]) == fqns
            assert set(sharding["params"].values()) == {((Shard(0),), True)}
            assert blocks and sharding["fsdp"] == sorted(["", *blocks])
        assert r["params_equal"]
        torch.testing.assert_close(r["logits"], r["expected"], rtol=1e-5, atol=1e-6)


def _generic_on_ranks() -> list[dict]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # Units may be any submodules: here the first child of each nn.Sequential part.
    parts = shard_parts(three_parts(), mesh, lambda part: [next(iter(part.children()))])
    return _sharding(parts)


def test_shard_parts_takes_any_model_and_its_own_units():
    """Not only llama: the units a caller names are sharded, then each part, nothing else."""
    r0, r1 = run_ranks(2, _generic_on_ranks)
    assert r0 == r1
    assert [s["fsdp"] for s in r0] == [["", "embed"], ["", "mid"], ["", "head"]]
    for sharding in r0:
        assert set(sharding["params"].values()) == {((Shard(0),), True)}


def test_no_mesh_leaves_parts_plain():
    """mesh None: the parts are split but neither wrapped nor turned into DTensors."""
    torch.manual_seed(0)
    model = Transformer(FLAVORS["tiny"])
    names = [n for n, _ in model.named_parameters()]
    parts = parallelize(model, ModelConfig(flavor="tiny", num_parts=2), None, [0, 1])
    assert len(parts) == 2
    for sharding in _sharding(parts):
        assert sharding["fsdp"] == []
        assert set(sharding["params"].values()) == {None}
    assert [n for s in _sharding(parts) for n in s["params"]] == names
    generic = three_parts()
    assert shard_parts(generic, None, lambda part: part.children()) is generic
    assert not any(isinstance(m, FSDPModule) for part in generic for m in part.modules())


def test_llama_parallelize_refuses_another_model():
    with pytest.raises(TypeError, match="expected a llama Transformer"):
        parallelize(nn.Linear(2, 2), ModelConfig(), None, [0])
