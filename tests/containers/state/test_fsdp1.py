"""Containers on FSDP1 parts (`FullyShardedDataParallel(use_orig_params=True)`): the same
steps as on FSDP2, the same flat DCP format, checkpoints that move between the two."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from components.parallelize import shard_parts
from containers import (
    InBackward,
    LeanAdamW,
    MixedPrecisionOptimizersContainer,
    MixedPrecisionSettings,
    OptimizersContainer,
    OptimizersInBackwardContainer,
    ParamGroupRule,
    TorchFTGate,
)
from tests.harness.dist import run_ranks
from tests.harness.helpers import assert_same, batch, forward, full, three_parts

STEPS = 10
RULES = [ParamGroupRule(r"bias|norm", {"weight_decay": 0.0})]


def _units(part: nn.Module) -> list[nn.Module]:
    # The middle part gets a unit of its own: parameters in two flat parameters.
    return [part.mid] if hasattr(part, "mid") else []


def _parts(
    impl: str, dtype: torch.dtype = torch.float32, seed: int = 0, replicas: int = 1
) -> list[nn.Module]:
    """three_parts sharded by `impl` over the world; HSDP with `replicas` > 1 (FSDP1's
    HYBRID_SHARD)."""
    shape = (replicas, dist.get_world_size() // replicas)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard"))
    parts = [p.to(dtype) for p in three_parts(seed)]
    return shard_parts(parts, mesh, _units, impl)


def _container(kind: str, parts: list[nn.Module]) -> OptimizersContainer:
    if kind == "mixed_precision":
        return MixedPrecisionOptimizersContainer(
            parts, torch.optim.AdamW, {"lr": 1e-2}, param_groups=RULES, max_norm=0.0
        )
    if kind == "sgd_momentum":
        return OptimizersContainer(
            parts, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, param_groups=RULES
        )
    # max_norm 0: the global norm is measured (and compared), the update stays bitwise.
    # Not fused: torch's fused CPU AdamW rounds its vector lanes and its scalar tail apart,
    # so its results depend on where a slice starts (1 ulp in exp_avg_sq, measured).
    return OptimizersContainer(
        parts, torch.optim.AdamW, {"lr": 1e-2, "foreach": True}, param_groups=RULES, max_norm=0.0
    )


def _run(kind: str, impl: str) -> dict:
    rank = dist.get_rank()
    dtype = torch.bfloat16 if kind == "mixed_precision" else torch.float32
    parts = _parts(impl, dtype, replicas=2 if kind == "hsdp" else 1)
    opt = _container(kind, parts)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        opt.backward(forward(parts, batch(step, rank).to(dtype)).float().square().mean())
        opt.step()
        assert opt.last_report.committed
        norms.append(opt.last_report.grad_norm)
    sd = opt.state_dict()
    return {
        "keys": sorted(sd),
        "state": {k: full(v) for k, v in sd.items()},
        # The models' full state dicts (FSDP1's default gathers them too), clean FQNs.
        "params": {
            k.replace("_fsdp_wrapped_module.", ""): full(v)
            for part in parts
            for k, v in part.state_dict().items()
        },
        "norms": norms,
    }


def _both(kind: str) -> tuple[dict, dict]:
    return _run(kind, "fsdp1"), _run(kind, "fsdp2")


@pytest.mark.parametrize(
    ("kind", "world"),
    [("default", 2), ("sgd_momentum", 2), ("mixed_precision", 2), ("hsdp", 4)],
)
def test_each_container_on_fsdp1_parts_is_bitwise_the_same_on_fsdp2_over_10_steps(kind, world):
    """FSDP1 (FULL_SHARD; HYBRID_SHARD 2 x 2 for hsdp) against FSDP2 (HSDP): the same weights
    and optimizer state, bit for bit, under the same keys; the global norm counts each
    element once (replicas too), as on FSDP2."""
    for fsdp1, fsdp2 in run_ranks(world, _both, kind):
        assert_same(fsdp1["params"], fsdp2["params"])
        assert_same(fsdp1["state"], fsdp2["state"])  # keys, full shapes and every element
        assert not [k for k in fsdp1["keys"] if "_fsdp_wrapped_module" in k or "_flat_param" in k]
        if kind != "sgd_momentum":
            # Summed over other pieces: equal up to the order of the sums.
            assert fsdp1["norms"] == pytest.approx(fsdp2["norms"], rel=1e-5)
            assert all(n > 0 for n in fsdp1["norms"])


def _refusals() -> list[str]:
    """What each container that cannot work on FSDP1 parts says when built."""
    parts = _parts("fsdp1")
    attempts = {
        "in_backward": lambda: OptimizersInBackwardContainer(parts, torch.optim.AdamW, {}),
        # Refused when built, before the manager is ever used.
        "fault_tolerant": lambda: OptimizersContainer(
            parts, torch.optim.AdamW, {}, gate=TorchFTGate(manager=None)
        ),
        "adafactor": lambda: OptimizersContainer(parts, torch.optim.Adafactor, {}),
        "muon": lambda: OptimizersContainer(
            parts,
            torch.optim.AdamW,
            {},
            param_groups=[ParamGroupRule("head.weight", {}, torch.optim.Muon, {})],
        ),
        "in_backward_mixed": lambda: MixedPrecisionOptimizersContainer(
            parts, torch.optim.AdamW, {}, settings=MixedPrecisionSettings(), timing=InBackward()
        ),
        "coded": lambda: OptimizersContainer(parts, LeanAdamW, {"moment_dtype": "8bit"}),
    }
    said = []
    for attempt in attempts.values():
        with pytest.raises(ValueError) as e:
            attempt()
        said.append(str(e.value))
    return said


def test_containers_that_cannot_work_on_fsdp1_are_refused_when_built_with_the_fix():
    in_backward, ft, adafactor, muon, mixed, coded = run_ranks(2, _refusals)[0]
    assert "gives the original parameters theirs only when backward has ended" in in_backward
    assert "with TorchFTGate (torchft): torchft serves a healing peer" in ft
    assert "Adafactor on FSDP1 parameters" in adafactor
    assert "Muon on FSDP1 parameters" in muon and "AdamW" in muon
    assert "model parts with InBackward (units step inside backward): FSDP1" in mixed
    assert "moment_dtype = '8bit' on FSDP1 parameters" in coded and "'fsdp2'" in coded


# -- checkpoints move between FSDP1 and FSDP2 at other world sizes -----------------------------


def _save(impl: str, path: str) -> dict:
    parts = _parts(impl)
    opt = _container("default", parts)
    for step in range(3):
        opt.zero_grad()
        forward(parts, batch(step, dist.get_rank())).square().mean().backward()
        opt.step()
    dcp.save({"optim": opt}, checkpoint_id=path)
    return {k: full(v) for k, v in opt.state_dict().items()}


def _load(impl: str, path: str) -> dict:
    parts = _parts(impl, seed=1)
    opt = _container("default", parts)
    dcp.load({"optim": opt}, checkpoint_id=path)
    return {k: full(v) for k, v in opt.state_dict().items()}


@pytest.mark.parametrize(("saver", "loader"), [("fsdp1", "fsdp2"), ("fsdp2", "fsdp1")])
def test_optimizer_state_saved_at_2_ranks_loads_identically_at_3_on_the_other_fsdp(
    tmp_path, saver, loader
):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(2, _save, saver, path)[0]
    assert saved["state.embed.weight.exp_avg"].shape == (7, 10)
    assert saved["state.embed.weight.step"] == 3
    for loaded in run_ranks(3, _load, loader, path):
        assert_same(loaded, saved)
