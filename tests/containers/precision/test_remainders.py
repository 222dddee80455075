"""containers/precision/remainders.py: fp32 masters as bf16 parameters + 16-bit remainders."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from components.checkpoint import ModelWrapper
from containers import (
    InBackward,
    LeanAdamW,
    MasterWeights,
    MixedPrecisionOptimizersContainer,
)
from containers import (
    MixedPrecisionSettings as MP,
)
from containers.precision import load_planner, remainders
from containers.precision.flat_adam import PAD
from tests.harness.dist import run_ranks
from tests.harness.helpers import (
    assert_same,
    batch,
    compiled_calls,
    forward,
    full,
    lean_compiled,
    three_parts,
)

SHAPES = [(4, PAD), (3 * PAD,), (PAD, 5), (7,), (5, 3)]
KW = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}
LEAN = {**KW, "moment_dtype": "bfloat16"}


def test_a_master_split_and_joined_is_the_same_bits_and_its_parameter_the_nearest_bf16(
    monkeypatch,
):
    monkeypatch.setattr(remainders, "STORE_NUMEL", 1000)  # stored a few rows at a time
    g = torch.Generator().manual_seed(0)
    edges = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3.4e38, -3.4e38, 1.0, -1.0])
    ties = (torch.randint(-(2**15), 2**15, (64,), generator=g, dtype=torch.int32) << 16) | 0x8000
    master = torch.cat([torch.randn(10_000, generator=g) * 100, edges, ties.view(torch.float32)])
    param = torch.empty((8, 1259), dtype=torch.bfloat16).t()  # a view, as a piece's target
    rem = torch.empty((1259, 8), dtype=torch.int16)
    remainders.store(master, param, rem)
    param, rem = param.reshape(-1), rem.reshape(-1)
    joined = remainders.masters_of(param, rem)
    assert torch.equal(joined.view(torch.int32), master.view(torch.int32))
    nearest = master.to(torch.bfloat16)
    differ = (param.view(torch.int16) != nearest.view(torch.int16)).nonzero().flatten()
    # Only exact ties round otherwise (away from zero, torch's to even), and then by one ulp.
    assert ((master.view(torch.int32)[differ] & 0xFFFF) == 0x8000).all() and len(differ) > 0
    assert (param.float().abs()[differ] > nearest.float().abs()[differ]).all()


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Module()
    for i, s in enumerate(SHAPES):
        m.register_parameter(f"w{i}", nn.Parameter(torch.randn(s).to(torch.bfloat16)))
    return m


def _container(model: nn.Module, keep: bool, kwargs=KW, cls=torch.optim.AdamW, **settings):
    mp = MixedPrecisionOptimizersContainer(
        [model], cls, kwargs,
        settings=MP(loss_scaling="none", store_param_remainders=keep, **settings),
    )  # fmt: skip
    for flat in mp.precision._flat[id(mp.optimizers[0])]:
        flat.chunk(2 * PAD)  # tensors span chunks
    return mp


def _step(mp, model: nn.Module, step: int, unused: int | None = None) -> None:
    torch.manual_seed(100 + step)
    for i, p in enumerate(model.parameters()):
        p.grad = None if i == unused else torch.randn(p.shape).to(torch.bfloat16)
    mp.precision.unscale = 0.3  # as a loss scale of 1 / 0.3 would
    mp.precision.apply(mp.optimizers)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(
    ("cls", "kwargs"), [(torch.optim.AdamW, KW), (LeanAdamW, LEAN)], ids=["fp32", "bf16_moments"]
)
@pytest.mark.slow
def test_remainders_keep_the_fp32_masters_bitwise_fed_the_same_gradients(
    cls, kwargs, compile, monkeypatch
):
    """Steps across chunk boundaries (eager) or in one graph (a `compiled` group), and one step with
    an unused parameter (torch's own step on the masters made whole for it): masters, state
    and parameters as with fp32 masters, in 2 bytes a parameter."""
    calls = compiled_calls(monkeypatch)
    runs = []
    for keep in (False, True):
        model = _model()
        mp = _container(model, keep, *lean_compiled(cls, kwargs, compile)[::-1])
        for step in range(5):
            _step(mp, model, step, unused=2 if step == 2 else None)
        runs.append((mp, model))
    # each run, every step, a graph call a tensor with a gradient: the flat step's, and the
    # group's own (compiled) step's after the unused parameter made the counts uneven
    assert len(calls) == 2 * (5 * len(SHAPES) - 1) * compile
    (plain, plain_model), (kept, kept_model) = runs
    (flat,) = kept.precision._flat[id(kept.optimizers[0])]
    assert "master" not in flat.buffers and flat.buffers["remainder"].dtype == torch.int16
    assert all(m.untyped_storage().nbytes() == 4 for m in flat.masters)  # one NaN, no copy
    assert all(m.isnan().all() for m in flat.masters)  # a stray read is loud
    assert not flat.uniform  # the unused parameter's count stays behind: torch's steps ran
    assert_same(kept.state_dict(), plain.state_dict())
    for p, q in zip(kept_model.parameters(), plain_model.parameters()):
        # the same rounding but at exact ties (away from zero, not to even)
        assert (p.view(torch.int16) - q.view(torch.int16)).abs().max() <= 1


def test_a_checkpoint_of_either_policy_loads_into_the_other_and_resumes_bitwise():
    runs = {}
    for keep in (False, True):
        model = _model()
        mp = _container(model, keep, LEAN, LeanAdamW)
        for step in range(2):
            _step(mp, model, step)
        runs[keep] = (mp, model)
    saved = {
        keep: {k: full(v) for k, v in mp.state_dict().items()} for keep, (mp, _) in runs.items()
    }
    assert_same(saved[True], saved[False])  # one format: fp32 masters, bf16 moments
    for keep in (False, True):
        model = _model(seed=1)
        mp = _container(model, not keep, LEAN, LeanAdamW)
        mp.load_state_dict(saved[keep])
        runs[(keep, "loaded")] = (mp, model)
    for step in (2, 3):
        for mp, model in runs.values():
            _step(mp, model, step)
    got = [mp.state_dict() for mp, _ in runs.values()]
    for other in got[1:]:
        assert_same(other, got[0])


def test_in_backward_with_remainders_and_bf16_moments_equals_the_step_after_backward():
    def bf16_parts():
        return [part.to(torch.bfloat16) for part in three_parts()]

    settings = MP(loss_scaling="none", store_param_remainders=True)
    runs = []
    for timing in (InBackward(), None):
        parts = bf16_parts()
        mp = MixedPrecisionOptimizersContainer(
            parts, LeanAdamW, LEAN, settings=settings, timing=timing
        )
        for step in range(3):
            mp.zero_grad()
            forward(parts, batch(step).bfloat16()).float().square().mean().backward()
            mp.step()
        runs.append((mp.state_dict(), [p.detach().clone() for q in parts for p in q.parameters()]))
    assert_same(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def _sharded(seed: int) -> tuple[list[nn.Module], MixedPrecisionOptimizersContainer]:
    precision = MasterWeights(MP(loss_scaling="none", store_param_remainders=True))
    parts = [precision.cast_model(part) for part in three_parts(seed)]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for part in parts:
        fully_shard(part, mesh=mesh)
    return parts, MixedPrecisionOptimizersContainer(parts, LeanAdamW, LEAN, precision=precision)


def _save(path: str) -> dict:
    parts, container = _sharded(0)
    for step in range(3):
        container.zero_grad()
        x = batch(step, dist.get_rank()).bfloat16()
        forward(parts, x).float().square().mean().backward()
        container.step()
    dcp.save({"model": ModelWrapper(parts), "optim": container}, checkpoint_id=path)
    weights = {k: full(v) for part in parts for k, v in part.named_parameters()}
    return {**{k: full(v) for k, v in container.state_dict().items()}, "weights": weights}


def _load(path: str, planned: bool) -> dict:
    parts, container = _sharded(1)
    states = {"model": ModelWrapper(parts), "optim": container}
    if planned:  # as the checkpoint manager loads: no master is ever made fp32
        made = []
        flats = {id(f): f for f, _ in container.precision.flat_of.values()}.values()
        for flat in flats:
            flat.master_value = lambda i: made.append(i)  # type: ignore[method-assign]
        with load_planner(states) as planner:
            dcp.load(states, checkpoint_id=path, planner=planner)
        assert not made and planner is not None and planner._skip  # model entries not read
        for flat in flats:
            del flat.master_value
    else:  # DCP's own planner: into fp32 templates
        dcp.load(states, checkpoint_id=path)
    weights = {k: full(v) for part in parts for k, v in part.named_parameters()}
    return {**{k: full(v) for k, v in container.state_dict().items()}, "weights": weights}


@pytest.mark.parametrize("planned", [True, False], ids=["load_planner", "dcp_default"])
def test_remainders_and_bf16_moments_saved_on_2_fsdp2_ranks_load_on_3_element_for_element(
    tmp_path, planned
):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(2, _save, path)[0]
    assert saved["master_weights.embed.weight"].dtype == torch.float32
    assert saved["state.embed.weight.exp_avg"].dtype == torch.bfloat16
    loaded = run_ranks(3, _load, path, planned)[0]
    assert_same(loaded.pop("weights"), saved.pop("weights"))  # each its master, rounded
    assert_same(loaded, saved)


@pytest.mark.parametrize(
    ("settings", "cls", "kwargs", "match"),
    [
        ({"param_dtype": "float16"}, torch.optim.AdamW, {}, "param_dtype 'float16'"),
        ({}, torch.optim.SGD, {}, "store_param_remainders = true with only SGD"),
        ({}, torch.optim.AdamW, {"fused": False}, "AdamW group that is not fused"),
    ],
)
def test_remainders_where_they_cannot_complete_a_master_are_refused_by_name(
    settings, cls, kwargs, match
):
    dtype = getattr(torch, settings.get("param_dtype", "bfloat16"))
    model = nn.Linear(4, 4).to(dtype)
    with pytest.raises(ValueError, match=match):
        MixedPrecisionOptimizersContainer(
            [model], cls, {"lr": 0.1, **kwargs},
            settings=MP(loss_scaling="none", store_param_remainders=True, **settings),
        )  # fmt: skip


def test_muon_groups_keep_fp32_masters_beside_remainders_of_adamw_groups(caplog):
    from containers import ParamGroupRule, ShardedMuon

    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.LayerNorm(8)).to(torch.bfloat16)
    rules = [ParamGroupRule(r"^0\.weight$", {"lr": 0.02}, ShardedMuon, {"lr": 0.02})]
    with caplog.at_level("INFO"):
        mp = MixedPrecisionOptimizersContainer(
            [model], torch.optim.AdamW, {"lr": 1e-2, "fused": True}, param_groups=rules,
            settings=MP(loss_scaling="none", store_param_remainders=True),
        )  # fmt: skip
    assert "the ShardedMuon groups keep fp32 masters" in caplog.text
    flats = [f for opt in mp for f in mp.precision._flat.get(id(opt), [])]
    assert flats and all(f.remainders for f in flats)
    for step in range(2):
        mp.zero_grad()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).bfloat16()
        model(x).float().square().mean().backward()
        mp.step()
    assert mp.last_step_committed
    state = mp.state_dict()
    masters = [k for k in state if k.startswith("master_weights.")]
    assert sorted(masters) == [
        "master_weights.0.weight",
        "master_weights.1.bias",
        "master_weights.1.weight",
    ]
    assert all(bool(state[k].isfinite().all()) for k in masters)


def test_the_config_builds_remainders_with_bf16_moments_and_refuses_fp16_by_name():
    from components.optimizer import build_optimizers, build_precision
    from config import ConfigError, MixedPrecision
    from config import Optimizer as OptimizerConfig

    cfg = OptimizerConfig(container="mixed_precision", moment_dtype="bfloat16")
    precision = build_precision(cfg, MixedPrecision(store_param_remainders=True))
    parts = [precision.cast_model(p) for p in three_parts()]
    container = build_optimizers(parts, cfg, precision=precision)
    flats = [f for opt in container for f in container.precision._flat[id(opt)]]
    assert flats and all(f.remainders and f.codec.name == "bfloat16" for f in flats)
    with pytest.raises(ConfigError, match=r"store_param_remainders = true with param_dtype"):
        build_precision(cfg, MixedPrecision(store_param_remainders=True, param_dtype="float16"))
