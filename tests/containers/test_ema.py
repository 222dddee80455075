"""ShadowWeights: the EMA of the stepped weights as container state, updated in the step."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp

from components.checkpoint import ModelWrapper
from containers import (
    FTOptimizersContainer,
    InBackward,
    MasterWeights,
    MixedPrecisionOptimizersContainer,
    MixedPrecisionSettings,
    OptimizersContainer,
    OptimizersInBackwardContainer,
    ShadowWeights,
)
from tests.containers.gate.test_fault_tolerant import manager  # noqa: F401 (a fixture)
from tests.harness.helpers import (
    assert_same,
    batch,
    forward,
    full,
    full_state,
    sharded_three_parts,
    three_parts,
    train,
)

KW = {"lr": 1e-2, "weight_decay": 0.1}


def _weights(opt: OptimizersContainer) -> list[torch.Tensor]:
    return [full(p) for g in opt.param_groups for p in g["params"]]


def _ema(opt: OptimizersContainer) -> list[torch.Tensor]:
    return [full(s) for s in opt.ema.averages()]


def test_the_ema_is_the_closed_form_over_the_recorded_weights_and_skipped_steps_do_not_count():
    """decay 0.8, every 2nd applied step from start_step 3, 10 training steps of which the
    5th has a NaN loss (skipped): the average is torch's lerp of the recorded weights,
    bitwise, and the fp64 closed form sum_k (1 - d) d^(m-k) w_k + d^m w_start within 2 ulp."""
    parts = three_parts()
    opt = OptimizersContainer(
        parts, torch.optim.AdamW, KW, ema=ShadowWeights(0.8, update_every_n_steps=2, start_step=3)
    )
    trajectory = []  # the weights after each applied step
    for step in range(10):
        opt.zero_grad()
        loss = forward(parts, batch(step)).square().mean()
        opt.backward(loss * math.nan if step == 4 else loss)
        opt.step()
        if opt.last_step_committed:
            trajectory.append(_weights(opt))
    assert len(trajectory) == 9 and opt.ema.steps == 9
    # By hand: a copy through applied step 3, then steps 5, 7, 9 fold in.
    ref = [w.clone() for w in trajectory[2]]
    for n in (5, 7, 9):
        for r, w in zip(ref, trajectory[n - 1]):
            r.lerp_(w, 1 - 0.8)
    assert all(torch.equal(a, b) for a, b in zip(_ema(opt), ref))
    for i, got in enumerate(_ema(opt)):
        closed = 0.8**3 * trajectory[2][i].double()
        for m, n in enumerate((5, 7, 9)):
            closed += (1 - 0.8) * 0.8 ** (2 - m) * trajectory[n - 1][i].double()
        ulp = torch.finfo(torch.float32).eps * closed.abs().clamp_min(1e-30).float()
        assert ((got - closed.float()).abs() <= 2 * ulp).all(), i
    # The weights moved off the average: the EMA is not the weights.
    assert not all(torch.equal(a, b) for a, b in zip(_ema(opt), trajectory[-1]))


def test_the_ema_is_torchs_averaged_model_with_its_ema_function():
    """torch's own EMA (`swa_utils.AveragedModel` with `get_ema_multi_avg_fn`, updated after
    each `optimizer.step()`; its first update copies the weights) beside the container's with
    start_step 1, over the same 6 steps of torch's AdamW: the averages are bitwise equal."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    parts, ref_parts = three_parts(), three_parts()
    opt = OptimizersContainer(parts, torch.optim.AdamW, KW, ema=ShadowWeights(0.8, start_step=1))
    ref_model = torch.nn.Sequential(*ref_parts)
    ref = torch.optim.AdamW(ref_model.parameters(), **KW)
    averaged = AveragedModel(ref_model, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    for step in range(6):
        train(parts, opt, 1, start=step)
        train(ref_parts, ref, 1, start=step)
        averaged.update_parameters(ref_model)
        got, want = _ema(opt), [p.detach() for p in averaged.module.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), step


@pytest.mark.parametrize("precision", ["fp32", "bf16_masters"])
def test_ema_weights_swaps_the_average_in_and_the_weights_back_bitwise(precision):
    parts, ema, dtype = three_parts(), ShadowWeights(0.5), torch.float32
    if precision == "fp32":
        opt = OptimizersContainer(parts, torch.optim.AdamW, KW, ema=ema)
    else:  # the average of the fp32 masters, rounded into the bf16 parameters
        masters, dtype = MasterWeights(MixedPrecisionSettings()), torch.bfloat16
        parts = [masters.cast_model(p) for p in parts]
        opt = MixedPrecisionOptimizersContainer(
            parts, torch.optim.AdamW, KW, precision=masters, ema=ema
        )
    for step in range(3):
        opt.zero_grad()
        opt.backward(forward(parts, batch(step).to(dtype)).float().square().mean())
        opt.step()
    before = [full(p) for m in parts for p in m.parameters()]
    with opt.ema_weights():
        inside = [full(p) for m in parts for p in m.parameters()]
        expected = [s.to(w.dtype) for s, w in zip(_ema(opt), before)]
        assert all(torch.equal(a, b) for a, b in zip(inside, expected))
        assert not all(torch.equal(a, b) for a, b in zip(inside, before))
    after = [full(p) for m in parts for p in m.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    plain = OptimizersContainer(three_parts(), torch.optim.AdamW, KW)
    with (
        pytest.raises(ValueError, match=r"keeps no EMA; build it with ema=ShadowWeights"),
        plain.ema_weights(),
    ):
        pass


def _run(parts, steps: range, path=None, load=None, ema=True, fit=True):
    opt = OptimizersContainer(
        parts, torch.optim.AdamW, KW, ema=ShadowWeights(0.7, start_step=1) if ema else None
    )
    states = {"model": ModelWrapper(parts), "optim": opt}
    if load is not None:
        if fit:  # as the checkpoint manager loads: the template fitted to the keys
            keys = dcp.FileSystemReader(load).read_metadata().state_dict_metadata
            opt.check_checkpoint_keys([k.removeprefix("optim.") for k in keys])
        dcp.load(states, checkpoint_id=load)
    train(parts, opt, len(steps), start=steps.start)
    if path is not None:
        dcp.save(states, checkpoint_id=path)
    return opt


def test_a_resume_goes_on_bitwise_and_a_checkpoint_without_the_ema_starts_it_from_its_weights(
    tmp_path, caplog
):
    straight = _run(three_parts(), range(6))
    path = str(tmp_path / "ckpt")
    _run(three_parts(), range(3), path=path)
    resumed = _run(three_parts(seed=1), range(3, 6), load=path, fit=False)
    assert_same(resumed.state_dict(), straight.state_dict())
    assert "ema.steps" in straight.state_dict() and straight.ema.steps == 6

    plain = str(tmp_path / "plain")
    _run(three_parts(), range(3), path=plain, ema=False)
    with caplog.at_level(logging.INFO, logger="containers.ema"):
        started = _run(three_parts(seed=1), range(3, 3), load=plain)
    assert "holds no EMA (ema.*): it starts from the loaded weights" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(_ema(started), _weights(started)))
    assert started.state_dict()["ema.steps"] == 0
    with pytest.raises(ValueError, match=r"holds an EMA of the weights \(ema\.\*\) and this"):
        _run(three_parts(), range(0), load=path, ema=False)  # would drop it: refused


def _sharded(seed: int) -> tuple[list, OptimizersContainer]:
    parts = sharded_three_parts(seed)
    return parts, OptimizersContainer(parts, torch.optim.AdamW, KW, ema=ShadowWeights(0.9))


def _save(path: str) -> dict:
    import torch.distributed as dist

    parts, opt = _sharded(0)
    train(parts, opt, 3, rank=dist.get_rank())
    dcp.save({"optim": opt}, checkpoint_id=path)
    return full_state(opt, "ema.")


def _load(path: str) -> dict:
    _, opt = _sharded(1)
    dcp.load({"optim": opt}, checkpoint_id=path)
    return full_state(opt, "ema.")


def test_the_ema_saved_on_2_fsdp2_ranks_loads_on_3_element_for_element(tmp_path):
    from tests.harness.dist import run_ranks

    path = str(tmp_path / "ckpt")
    saved = run_ranks(2, _save, path)[0]
    assert saved["ema.steps"] == 3 and "ema.head.weight" in saved
    assert_same(run_ranks(3, _load, path)[0], saved)


def test_in_backward_each_unit_updates_its_average_as_it_applies_equal_to_after_backward():
    """Units update their part of the average inside backward: after 4 steps (decay 0.6,
    every 2nd step) the average is the after-backward container's, bitwise."""
    parts, ref_parts = three_parts(), three_parts()
    ib = OptimizersInBackwardContainer(
        parts, torch.optim.AdamW, KW, ema=ShadowWeights(0.6, update_every_n_steps=2)
    )
    ref = OptimizersContainer(
        ref_parts, torch.optim.AdamW, KW, ema=ShadowWeights(0.6, update_every_n_steps=2)
    )
    train(parts, ib, 4)
    train(ref_parts, ref, 4)
    assert ib.ema.steps == 4
    assert all(torch.equal(a, b) for a, b in zip(_ema(ib), _ema(ref)))
    assert_same(ib.state_dict(), ref.state_dict())


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match=r"decay = 1.0: use a weight in \[0, 1\)"):
        ShadowWeights(1.0)
    with pytest.raises(ValueError, match=r"update_every_n_steps = 0: use 1 or more"):
        ShadowWeights(0.9, update_every_n_steps=0)


@pytest.mark.parametrize("in_backward", [False, True], ids=["after", "in_backward"])
def test_an_ema_of_remainder_masters_is_the_ema_of_the_fp32_masters_bitwise(in_backward):
    """The EMA reads each master through the precision (decoded from its bf16 parameter and
    remainder): fed the same gradients, the average, its saved entries and the masters are
    those of fp32 masters, bit for bit, after backward or inside it."""
    states = []
    for keep in (False, True):
        parts = [part.bfloat16() for part in three_parts()]
        container = MixedPrecisionOptimizersContainer(
            parts, torch.optim.AdamW, {**KW, "fused": True},
            settings=MixedPrecisionSettings(store_param_remainders=keep),
            ema=ShadowWeights(0.5), timing=InBackward() if in_backward else None,
        )  # fmt: skip
        params = [p for part in parts for p in part.parameters()]
        g = torch.Generator().manual_seed(7)
        grads = [[torch.randn(p.shape, generator=g).bfloat16() for p in params] for _ in range(3)]
        for step in range(3):
            container.zero_grad()
            loss = sum((p.float() * d.float()).sum() for p, d in zip(params, grads[step]))
            loss.backward()
            container.step()
        assert container.ema.steps == 3
        states.append(container.state_dict())
    assert_same(states[0], states[1])
    assert any(k.startswith("ema.") for k in states[0])


def test_under_torchft_only_committed_steps_update_the_average(manager):  # noqa: F811
    """A real lighthouse, one replica group: 3 committed steps give the plain container's
    average bitwise; a step torchft does not commit leaves it and its step count as they were."""
    parts, ref_parts = three_parts(), three_parts()
    ema = ShadowWeights(0.5)
    ft = FTOptimizersContainer(parts, torch.optim.AdamW, KW, ft_manager=manager, ema=ema)
    ref = OptimizersContainer(ref_parts, torch.optim.AdamW, KW, ema=ShadowWeights(0.5))
    train(parts, ft, 3)
    train(ref_parts, ref, 3)
    assert all(torch.equal(a, b) for a, b in zip(_ema(ft), _ema(ref)))
    ft.zero_grad()
    forward(parts, batch(99)).square().mean().backward()
    manager.report_error(RuntimeError("a peer died mid-allreduce"))
    ft.step()
    assert not ft.last_step_committed and ft.ema.steps == 3
    assert all(torch.equal(a, b) for a, b in zip(_ema(ft), _ema(ref)))
