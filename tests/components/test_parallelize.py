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

from components.job import build_job
from components.models.llama.model import FLAVORS, Transformer, split_model
from components.models.llama.parallelize import parallelize
from components.parallel_dims import ParallelDims
from components.parallelize import mixed_precision_policy, shard_parts, stage_group
from config import Model as ModelConfig
from config import Training, load_job_config
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


class _Probe(nn.Module):
    """loss = sum(w * x): the gradient of `w` is the input, so each rank picks its own."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))
        self.compute_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.compute_dtype = self.w.dtype  # the unsharded parameter FSDP2 computes with
        return (self.w * x).sum()


# (mixed_precision_param, mixed_precision_reduce) -> (compute dtype, reduced gradient)
_POLICIES = {
    ("float32", "float32"): (torch.float32, 0.5 + 2.0**-10),
    ("float32", "bfloat16"): (torch.float32, 0.5),
    ("bfloat16", "float32"): (torch.bfloat16, 0.5 + 2.0**-10),
}


def _policies_on_ranks() -> dict:
    mesh = init_device_mesh("cpu", (2,))
    # Gradients 1 (rank 0) and 2^-9 (rank 1), both exact in bf16: their mean 0.5 + 2^-10
    # needs 10 significant bits, so a bf16 reduction (8) rounds it to 0.5.
    x = torch.full((2,), 1.0 if dist.get_rank() == 0 else 2.0**-9)
    seen = {}
    for param, reduce in _POLICIES:
        training = Training(mixed_precision_param=param, mixed_precision_reduce=reduce)
        (probe,) = shard_parts(
            [_Probe()], mesh, lambda part: [], mp_policy=mixed_precision_policy(training)
        )
        probe(x).backward()
        seen[param, reduce] = (probe.compute_dtype, probe.w.grad.dtype, probe.w.grad.to_local())
    return seen


def test_mixed_precision_options_reach_fully_shard():
    """`[training] mixed_precision_param` sets the dtype FSDP2 computes in and
    `mixed_precision_reduce` the one it sums gradients in: a sum that bf16 rounds is exact in
    fp32; the sharded gradient stays fp32 either way."""
    for seen in run_ranks(2, _policies_on_ranks):
        for key, (compute, reduced) in _POLICIES.items():
            dtype, grad_dtype, grad = seen[key]
            assert (dtype, grad_dtype) == (compute, torch.float32), key
            assert grad.tolist() == [reduced], key


def _llama_policy_on_ranks(dump: str) -> dict:
    args = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size"]
    args += ["2", "--training.mixed_precision_param", "bfloat16", "--job.dump_folder", dump]
    job = build_job(load_job_config(args))
    seen = {}

    def record(block: nn.Module, inputs: tuple) -> None:
        h, rope = inputs
        seen["block"] = (h.dtype, rope.dtype, block.attention.wq.weight.dtype)

    job.model_parts[0].layers["0"].register_forward_pre_hook(record)
    job.forward_backward(*next(job.dataloader))
    seen["grads"] = {p.grad.dtype for p in job.parameters()}
    job.close()
    return seen


def test_the_policy_computes_in_bf16_from_the_config_and_keeps_the_rotary_table_fp32(tmp_path):
    """Through `build_job`, `mixed_precision_param = "bfloat16"` reaches the llama family's
    `fully_shard` calls: a block runs on bf16 hidden states with bf16 weights, but its
    rotary table, a side input, is not cast (FSDP2 casts a module's float inputs; the
    blocks' policy does not); gradients land in the fp32 sharded parameters."""
    for seen in run_ranks(2, _llama_policy_on_ranks, str(tmp_path)):
        assert seen["block"] == (torch.bfloat16, torch.float32, torch.bfloat16)
        assert seen["grads"] == {torch.float32}


def _stage_sums() -> dict:
    mesh = ParallelDims(2, 1, 2, 1).build_mesh("cpu")  # pp 2 x dp_shard 2
    group = stage_group(mesh)
    seen = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(seen, group=group)
    return {"pp": mesh.get_local_rank("pp"), "sum": seen.item(), "alone": stage_group(None)}


def test_stage_group_sums_over_the_ranks_of_one_pipeline_stage_only():
    results = run_ranks(4, _stage_sums)
    # Row-major mesh (pp, dp_replicate, dp_shard, tp): ranks 0, 1 hold stage 0; 2, 3 stage 1.
    assert [r["pp"] for r in results] == [0, 0, 1, 1]
    assert [r["sum"] for r in results] == [1.0, 1.0, 5.0, 5.0]
    assert all(r["alone"] is None for r in results)
