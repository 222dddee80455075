"""Expert parallelism on real gloo ranks: the all-to-all dispatch and combine against every
expert held locally, and train.py at EP 2 x DP 2 (and HSDP) against EP 1 and one unsharded
process on the same data: the same losses and global gradient norms."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from components.models.moe.model import FLAVORS, MoE
from components.models.moe.parallelize import _split_experts
from components.parallelize import sub_mesh
from tests.harness.dist import run_ranks
from tests.test_train import BASE


def _dispatch_on_ranks() -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    moe = MoE(FLAVORS["tiny"])
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    whole = copy.deepcopy(moe)
    _split_experts(moe, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)))
    rank = dist.get_rank()
    # Each rank its own tokens, and more of them on rank 1: uneven splits both ways.
    x = torch.randn(2, 10 + 7 * rank, 64, generator=torch.Generator().manual_seed(rank))
    x_split, x_whole = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = moe(x_split), whole(x_whole)
    (out * x).sum().backward()
    (expected * x).sum().backward()
    w1 = moe.experts.w1
    return {
        "out": (out.detach(), expected.detach()),
        "x_grad": (x_split.grad, x_whole.grad),
        "router_grad": (moe.router.weight.grad, whole.router.weight.grad),
        "placements": (tuple(w1.placements), w1.to_local().shape),
        "w_grads": {n: p.grad.to_local() for n, p in moe.experts.named_parameters()},
        "whole_w_grads": {n: p.grad for n, p in whole.experts.named_parameters()},
        "counts": (moe.tokens_per_expert.clone(), whole.tokens_per_expert.clone()),
    }


@pytest.mark.slow
def test_tokens_reach_their_experts_on_other_ranks_and_gradients_come_back():
    """2 ranks, 2 of the 4 tiny experts each: outputs, input and router gradients as with
    every expert local; each rank's expert gradients the sum of both ranks' tokens' ones."""
    ranks = run_ranks(2, _dispatch_on_ranks)
    for r in ranks:
        for key in ("out", "x_grad", "router_grad", "counts"):
            torch.testing.assert_close(*r[key], rtol=1e-5, atol=1e-6)
        assert r["placements"] == ((Shard(0),), (2, 64, 32))
    for name in ("w1", "w2", "w3"):
        total = ranks[0]["whole_w_grads"][name] + ranks[1]["whole_w_grads"][name]
        for rank, r in enumerate(ranks):
            local = total[2 * rank : 2 * rank + 2]
            assert local.abs().sum() > 0
            torch.testing.assert_close(r["w_grads"][name], local, rtol=1e-5, atol=1e-6)


def _describe(job: Any) -> dict[str, Any]:
    experts = {
        name: (p.device_mesh.mesh_dim_names, tuple(p.placements), tuple(p.to_local().shape))
        for part in job.model_parts
        for name, p in part.named_parameters()
        if ".experts." in name and isinstance(p, DTensor)
    }
    mesh = job.mesh
    if mesh is None:  # one process
        return {"experts": experts}
    return {
        "mesh": mesh.mesh_dim_names,
        "dp_shard": sub_mesh(mesh, "dp_shard").mesh.tolist(),
        "dp": sub_mesh(mesh, "dp_replicate", "dp_shard").mesh.tolist(),
        "ep": sub_mesh(mesh, "ep").mesh.tolist() if "ep" in mesh.mesh_dim_names else None,
        "experts": experts,
        "dp_rank": job.dims.dp_rank(job.rank),
    }


def train_and_describe(argv: list[str]) -> dict[str, Any]:
    """`train.main(argv)` on this rank; its exit code, the job's mesh and where its routed
    experts live."""
    import train

    build_job, built = train.build_job, {}

    def recording_build_job(cfg: Any) -> Any:
        job = build_job(cfg)
        built.update(_describe(job))
        return job

    train.build_job = recording_build_job
    try:
        code = train.main(argv)
    finally:
        train.build_job = build_job
    return {"code": code, **built}


ARGS = [
    *BASE,
    "--model.name",
    "moe",
    "--training.global_batch_size",
    "8",  # 4 data-parallel ranks x 2, or one process accumulating 4 micro-batches
    "--training.steps",
    "10",
    "--checkpoint.enable",
    "false",
]
LAYOUTS = {
    "ep2_dp2": ["--parallelism.expert_parallel_degree", "2"],
    "ep1_dp4": [],
    "ep2_hsdp2": [
        "--parallelism.expert_parallel_degree",
        "2",
        "--parallelism.data_parallel_replicate_degree",
        "2",
    ],
}


def _rows(dump: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("ep")
    out = {}
    for name, flags in {"one": [], **LAYOUTS}.items():
        nproc = 1 if name == "one" else 4
        argv = [*ARGS, *flags, "--job.dump_folder", str(root / name)]
        ranks = run_ranks(nproc, train_and_describe, argv, timeout=240)
        assert [r["code"] for r in ranks] == [0] * nproc
        out[name] = (ranks, _rows(root / name))
    return out


@pytest.mark.slow
def test_ep2_x_dp2_trains_as_ep1_and_as_one_unsharded_process(runs):
    """fp32, the same global batch: every step's loss within 1e-6 relative, and the
    container's global gradient norm (over dense and expert meshes) within fp32 rounding."""
    _, one = runs["one"]
    assert len(one) == 10
    for name in LAYOUTS:
        _, rows = runs[name]
        assert [r["step"] for r in rows] == [r["step"] for r in one]
        for row, ref in zip(rows, one):
            assert abs(row["loss"] - ref["loss"]) <= 1e-6 * ref["loss"], (name, row, ref)
            assert row["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), (name, row)
            assert row["load_imbalance"] == pytest.approx(ref["load_imbalance"]), name
    assert one[-1]["loss"] < one[0]["loss"] - 0.5


def test_the_ep_mesh_is_carved_out_of_dp_shard_and_ranks_keep_their_batch(runs):
    ep2, _ = runs["ep2_dp2"]
    assert ep2[0]["mesh"] == ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")
    assert [r["ep"] for r in ep2] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(r["dp_shard"] == [0, 1, 2, 3] and r["dp"] == [[0, 1, 2, 3]] for r in ep2)
    assert [r["dp_rank"] for r in ep2] == [0, 1, 2, 3]
    # Each expert weight: 2 of the 4 experts per ep rank, FSDP2 over the 2 ranks outside ep.
    for r in ep2:
        assert len(r["experts"]) == 6  # 2 layers x w1, w2, w3
        for name, (dims, placements, local) in r["experts"].items():
            assert dims == ("dp_shard_mod_ep", "ep") and placements[1] == Shard(0), name
            assert local[0] == 1, name  # 4 experts / ep 2 / dp_shard_mod_ep 2
    hsdp, _ = runs["ep2_hsdp2"]
    assert [r["dp_rank"] for r in hsdp] == [0, 1, 2, 3]
    for r in hsdp:
        for dims, _, local in r["experts"].values():
            assert dims == ("dp_replicate", "dp_shard_mod_ep", "ep") and local[0] == 2
    ep1, _ = runs["ep1_dp4"]
    assert ep1[0]["mesh"] == ("pp", "dp_replicate", "dp_shard", "tp") and ep1[0]["ep"] is None
    for dims, placements, local in ep1[0]["experts"].values():
        assert dims == ("dp_shard",) and placements == (Shard(0),) and local[0] == 1
