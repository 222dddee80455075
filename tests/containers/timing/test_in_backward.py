"""OptimizersInBackwardContainer: same results as the default container, stepping in backward."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from components.lr_scheduler import build_lr_schedulers
from components.models.llama.data import ByteTextLoader
from components.models.llama.model import FLAVORS, Transformer, split_model
from components.optimizer import build_optimizers
from config import ConfigError, LRScheduler, load_job_config
from containers import (
    InBackward,
    MixedPrecisionOptimizersContainer,
    MixedPrecisionSettings,
    OptimizersContainer,
    OptimizersInBackwardContainer,
    ParamGroupRule,
)
from tests.harness.dist import run_ranks, train_ranks
from tests.harness.helpers import assert_same, full

KW = {"lr": 3e-3, "weight_decay": 0.1, "fused": True}
RULES = [ParamGroupRule("norm", {"weight_decay": 0.0})]


def _parts(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return split_model(Transformer(FLAVORS["tiny"]), 2)


def _loss(parts: list[nn.Module], inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    h = inputs
    for part in parts:
        h = part(h)
    return F.cross_entropy(h.flatten(0, 1), labels.flatten())


def _train(parts, optimizers, steps: int, accum: int = 1, rank: int = 0, world: int = 1) -> None:
    data = ByteTextLoader(32, 2, rank, world, seed=0)
    for _ in range(steps):
        optimizers.zero_grad()
        for _ in range(accum):
            (_loss(parts, *next(data)) / accum).backward()
        optimizers.step()


def _params(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    return {k: full(v) for part in parts for k, v in part.state_dict().items()}


def _pair(accum: int = 1) -> tuple[list, OptimizersInBackwardContainer, list, OptimizersContainer]:
    parts, ref_parts = _parts(), _parts()
    ib = OptimizersInBackwardContainer(
        parts, torch.optim.AdamW, KW, param_groups=RULES, gradient_accumulation_steps=accum
    )
    default = OptimizersContainer(ref_parts, torch.optim.AdamW, KW, param_groups=RULES)
    return parts, ib, ref_parts, default


@pytest.mark.parametrize(("accum", "steps"), [(1, 10), (3, 4)])  # 4: the suite's time budget
def test_bitwise_equal_to_the_default_container(accum, steps):
    parts, ib, ref_parts, default = _pair(accum)
    assert len(ib) > len(default) == 2  # finer-grained units, one optimizer each
    _train(parts, ib, steps, accum)
    _train(ref_parts, default, steps, accum)
    assert_same(_params(parts), _params(ref_parts))
    assert_same(ib.state_dict(), default.state_dict())


def test_steps_happen_in_backward_once_per_step_under_accumulation():
    parts, ib, _, _ = _pair(accum=3)
    inner_steps = []
    for opt in ib.optimizers:
        opt.register_step_post_hook(lambda o, a, k: inner_steps.append(o))
    container_steps = []
    ib.register_step_post_hook(lambda o, a, k: container_steps.append(o))
    data = ByteTextLoader(32, 2, 0, 1, seed=0)
    before = _params(parts)
    ib.zero_grad()
    for micro in range(3):
        _loss(parts, *next(data)).backward()
        grads = [p.grad for part in parts for p in part.parameters()]
        if micro < 2:  # accumulating: nothing stepped, gradients kept
            assert not inner_steps and all(g is not None for g in grads)
            assert_same(_params(parts), before)
    # the last backward stepped every unit once and freed every gradient
    assert sorted(map(id, inner_steps)) == sorted(map(id, ib.optimizers))
    assert all(g is None for g in grads)
    ib.step()
    assert len(inner_steps) == len(ib.optimizers) and len(container_steps) == 1


class _Gated(nn.Module):
    """Its second parameter gets a gradient only on odd calls (an unused parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, 4))
        self.b = nn.Parameter(torch.randn(4, 4))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x @ self.a + (x @ self.b if self.calls % 2 else 0)


@pytest.mark.parametrize("accum", [1, 2])
def test_parameters_without_gradient_in_the_last_backward_still_match(accum):
    torch.manual_seed(0)
    model, ref = _Gated(), None
    ref = copy.deepcopy(model)
    ib = OptimizersInBackwardContainer(
        [model], torch.optim.AdamW, KW, gradient_accumulation_steps=accum
    )
    default = OptimizersContainer([ref], torch.optim.AdamW, KW)
    for step in range(6):
        for m, opt in ((model, ib), (ref, default)):
            opt.zero_grad()
            for micro in range(accum):
                x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step * 10 + micro))
                m(x).square().sum().backward()
            opt.step()
    assert torch.equal(model.a, ref.a) and torch.equal(model.b, ref.b)
    assert_same(ib.state_dict(), default.state_dict())


@pytest.mark.parametrize("accum", [1, 2])
def test_mixed_precision_in_backward_equals_mixed_precision_after_backward(accum):
    """The composition: bf16 parameters, fp32 masters stepped inside backward."""
    bf16 = [[p.to(torch.bfloat16) for p in _parts()] for _ in range(2)]
    cfg = load_job_config(
        [
            *("--optimizer.container", "mixed_precision", "--optimizer.early_step_in_backward"),
            *("--training.max_norm", "0", "--optimizer.lr", "3e-3"),
        ]
    )
    ib = build_optimizers(bf16[0], cfg.optimizer, gradient_accumulation_steps=accum, max_norm=0.0)
    assert isinstance(ib, MixedPrecisionOptimizersContainer) and isinstance(ib.timing, InBackward)
    ref = MixedPrecisionOptimizersContainer(bf16[1], torch.optim.AdamW, ib.defaults)
    freed = []
    # A hook after ours sees the last gradient of each unit already applied and freed.
    for p in bf16[0][1].parameters():
        p.register_post_accumulate_grad_hook(lambda p: freed.append(p.grad is None))
    _train(bf16[0], ib, 4, accum)
    _train(bf16[1], ref, 4, accum)
    last = freed[-len(list(bf16[0][1].parameters())) :]
    assert any(last), freed
    assert_same(_params(bf16[0]), _params(bf16[1]))
    assert_same(ib.state_dict(), ref.state_dict())
    assert ib.last_step_committed and ib.loss_scale == 1.0


def test_state_dict_covers_every_trainable_parameter_and_round_trips():
    parts, ib, _, _ = _pair()
    parts[0].layers["0"].requires_grad_(False)  # frozen parameters are allowed
    ib = OptimizersInBackwardContainer(parts, torch.optim.AdamW, KW, param_groups=RULES)
    trainable = {n for part in parts for n, p in part.named_parameters() if p.requires_grad}
    _train(parts, ib, 3)
    sd = ib.state_dict()
    assert {k[len("state.") : -len(".exp_avg")] for k in sd if k.endswith(".exp_avg")} == trainable
    assert len(trainable) == 12  # 21 in the tiny model, minus the 9 of the frozen block
    assert not any(k.startswith(("state.layers.0.", "param_groups.layers.0.")) for k in sd)
    snapshot = {k: full(v) for k, v in sd.items()}
    _train(parts, ib, 2)
    ib.load_state_dict(snapshot)
    assert_same({k: full(v) for k, v in ib.state_dict().items()}, snapshot)


def test_checkpoints_cross_load_with_the_default_container_both_ways():
    parts, ib, ref_parts, default = _pair()
    _train(parts, ib, 3)
    _train(ref_parts, default, 3)
    into_default = OptimizersContainer(
        copy.deepcopy(ref_parts), torch.optim.AdamW, KW, param_groups=RULES
    )
    into_default.load_state_dict(ib.state_dict())
    into_ib = OptimizersInBackwardContainer(
        copy.deepcopy(parts), torch.optim.AdamW, KW, param_groups=RULES
    )
    into_ib.load_state_dict(default.state_dict())
    assert_same(into_default.state_dict(), default.state_dict())
    assert_same(into_ib.state_dict(), ib.state_dict())
    _train(into_ib.model_parts, into_ib, 2)
    _train(into_default.model_parts, into_default, 2)
    assert_same(_params(into_ib.model_parts), _params(into_default.model_parts))


def test_lr_schedules_and_user_lr_changes_reach_every_unit():
    parts, ib, _, _ = _pair()
    schedulers = build_lr_schedulers(ib, LRScheduler(warmup_steps=4), total_steps=10)
    assert len(schedulers) == len(ib) and all(
        g["lr"] == pytest.approx(3e-3 / 5) for g in ib.param_groups
    )
    _train(parts, ib, 1)
    schedulers.step()
    assert all(g["lr"] == pytest.approx(3e-3 * 2 / 5) for g in ib.param_groups)
    for group in ib.param_groups:
        group["lr"] = 0.0
        group["weight_decay"] = 0.0
    before = _params(parts)
    _train(parts, ib, 1)
    assert_same(_params(parts), before)


def test_refused_combinations_name_the_key_and_the_fix():
    with pytest.raises(
        ConfigError,
        match=r"^\[optimizer\] container = 'in_backward' with \[training\] max_norm = 1.0: the "
        r"global gradient norm .*; set \[optimizer\] container = 'default' or set max_norm = 0$",
    ):
        load_job_config(["--optimizer.container", "in_backward"])
    with pytest.raises(
        ConfigError,
        match=r"early_step_in_backward = true with \[fault_tolerance\] enable = true: torchft",
    ):
        load_job_config(
            [
                *("--optimizer.early_step_in_backward", "--training.max_norm", "0"),
                "--fault_tolerance.enable",
            ]
        )
    with pytest.raises(ConfigError, match=r"loss_scaling = 'auto' with param_dtype 'float16'"):
        load_job_config(
            [
                *("--optimizer.container", "mixed_precision", "--optimizer.early_step_in_backward"),
                *("--training.max_norm", "0", "--mixed_precision.param_dtype", "float16"),
            ]
        )
    # The containers refuse the same compositions when built directly, in one place.
    with pytest.raises(ValueError, match=r"max_norm = 1\.0: the global gradient norm exists"):
        OptimizersContainer(_parts(), torch.optim.AdamW, KW, timing=InBackward(), max_norm=1.0)
    with pytest.raises(
        ValueError, match=r"InBackward .* with MasterWeights' loss scaling 'dynamic': an overflow"
    ):
        MixedPrecisionOptimizersContainer(
            [p.half() for p in _parts()], torch.optim.AdamW, KW, timing=InBackward(),
            settings=MixedPrecisionSettings(param_dtype="float16"),
        )  # fmt: skip
    cfg = load_job_config(["--optimizer.container", "in_backward", "--training.max_norm", "0"])
    ib = build_optimizers(_parts(), cfg.optimizer, gradient_accumulation_steps=2)
    assert isinstance(ib.timing, InBackward) and ib.timing.gradient_accumulation_steps == 2
    with pytest.raises(ValueError, match="closure"):
        ib.step(lambda: None)
    with pytest.raises(ValueError, match="gradient_accumulation_steps = 0"):
        OptimizersInBackwardContainer(
            _parts(), torch.optim.AdamW, KW, gradient_accumulation_steps=0
        )


# -- FSDP2 on gloo ranks -------------------------------------------------------------------


def _sharded(seed: int, dtype: torch.dtype = torch.float32) -> list[nn.Module]:
    parts = [part.to(dtype) for part in _parts(seed)]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for part in parts:
        for block in part.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(part, mesh=mesh)
    return parts


def _fsdp_equal_to_after_backward(precision: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    if precision == "bf16":
        parts, ref_parts = _sharded(0, torch.bfloat16), _sharded(0, torch.bfloat16)
        kw = {"lr": 3e-3, "weight_decay": 0.1}
        ib = MixedPrecisionOptimizersContainer(
            parts, torch.optim.AdamW, kw, param_groups=RULES, timing=InBackward(2)
        )
        default = MixedPrecisionOptimizersContainer(
            ref_parts, torch.optim.AdamW, kw, param_groups=RULES
        )
    else:
        parts, ref_parts = _sharded(0), _sharded(0)
        ib = OptimizersInBackwardContainer(
            parts, torch.optim.AdamW, KW, param_groups=RULES, gradient_accumulation_steps=2
        )
        default = OptimizersContainer(ref_parts, torch.optim.AdamW, KW, param_groups=RULES)
    units = len(ib)
    _train(parts, ib, 10, accum=2, rank=rank, world=world)
    _train(ref_parts, default, 10, accum=2, rank=rank, world=world)
    return {
        "units": units,
        "ib": _params(parts),
        "default": _params(ref_parts),
        "ib_state": {k: full(v) for k, v in ib.state_dict().items()},
        "default_state": {k: full(v) for k, v in default.state_dict().items()},
    }


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fsdp2_on_two_ranks_is_bitwise_equal_to_stepping_after_backward(precision):
    """Over 10 steps of 2 accumulated micro-batches; bf16: fp32 masters stepped in backward
    (loss scaling 'none', no clip) equal the mixed-precision container stepping after it."""
    result = run_ranks(2, _fsdp_equal_to_after_backward, precision)[0]
    assert result["units"] == 4  # 2 blocks + 2 part roots (embedding; norm + output)
    assert_same(result["ib"], result["default"])
    assert_same(result["ib_state"], result["default_state"])
    if precision == "bf16":
        assert {v.dtype for v in result["ib"].values()} == {torch.bfloat16}
        assert any(k.startswith("master_weights.") for k in result["ib_state"])


def _save_at_world(path: str) -> dict:
    parts = _sharded(0)
    ib = OptimizersInBackwardContainer(parts, torch.optim.AdamW, KW, param_groups=RULES)
    _train(parts, ib, 3, rank=dist.get_rank(), world=dist.get_world_size())
    dcp.save({"optim": ib}, checkpoint_id=path)
    return {k: full(v) for k, v in ib.state_dict().items()}


def _load_at_world(path: str) -> dict:
    ib = OptimizersInBackwardContainer(_sharded(7), torch.optim.AdamW, KW, param_groups=RULES)
    dcp.load({"optim": ib}, checkpoint_id=path)
    return {k: full(v) for k, v in ib.state_dict().items()}


def test_dcp_saved_at_4_ranks_loads_identically_at_2(tmp_path):
    saved = run_ranks(4, _save_at_world, str(tmp_path))[0]
    assert_same(run_ranks(2, _load_at_world, str(tmp_path))[0], saved)


def test_train_py_with_in_backward_matches_the_default_container(tmp_path):
    args = ["--job.config_file", "config/in_backward.toml", "--model.flavor", "tiny"]
    args += ["--training.steps", "6", "--lr_scheduler.warmup_steps", "2"]
    args += ["--training.seq_len", "32", "--metrics.log_freq", "1"]
    losses = {}
    for container in ("in_backward", "default"):
        dump = tmp_path / container
        extra = ["--job.dump_folder", str(dump), "--optimizer.container", container]
        result = train_ranks(1, [*args, *extra])
        assert result.returncode == 0, result.stdout[-3000:]
        lines = (dump / "metrics.jsonl").read_text().splitlines()
        losses[container] = [json.loads(line)["loss"] for line in lines]
    assert len(losses["in_backward"]) == 6
    assert losses["in_backward"] == losses["default"]
