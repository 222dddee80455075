"""LR schedules: warmup, each decay, WSD, min lr, and config lr winning on resume."""

from __future__ import annotations

import itertools
import logging
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from components.checkpoint.resume import ConfigSettings
from components.lr_scheduler import LRSchedulersContainer, build_lr_schedulers, lr_factor
from config import LRScheduler
from containers import OptimizersContainer, ParamGroupRule
from tests.harness.helpers import three_parts, train


def _lrs(cfg: LRScheduler, steps: int) -> list[float]:
    return [lr_factor(s, cfg, steps) for s in range(steps)]


def test_warmup_is_linear_from_above_zero_to_peak():
    lrs = _lrs(LRScheduler(warmup_steps=4, decay_ratio=0.0), 10)
    assert lrs[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert lrs[4:] == [1.0] * 6


@pytest.mark.parametrize(
    ("decay_type", "shape"),
    [
        ("linear", lambda p: 1 - p),
        ("sqrt", lambda p: 1 - math.sqrt(p)),
        ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
    ],
)
def test_each_decay_reaches_min_lr_at_the_last_step(decay_type, shape):
    cfg = LRScheduler(warmup_steps=2, decay_type=decay_type, min_lr_factor=0.1)
    lrs = _lrs(cfg, 10)  # 8 decay steps after warmup
    for step in range(2, 10):
        progress = (step - 2 + 1) / 8
        assert lrs[step] == pytest.approx(0.1 + 0.9 * shape(progress))
    assert lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(lrs[2:]))


def test_wsd_holds_the_peak_then_decays_the_last_fraction():
    lrs = _lrs(LRScheduler(warmup_steps=2, decay_ratio=0.25, min_lr_factor=0.0), 10)
    assert lrs[2:8] == [1.0] * 6  # 8 steps after warmup, 2 of them decay
    assert lrs[8:] == pytest.approx([0.5, 0.0])


def test_warmup_longer_than_training_is_clamped():
    assert _lrs(LRScheduler(warmup_steps=100), 3) == pytest.approx([0.25, 0.5, 0.75])


def test_schedulers_drive_every_inner_optimizer_and_group():
    parts = three_parts()
    rules = [ParamGroupRule("bias", {"lr": 0.5})]
    optimizers = OptimizersContainer(parts, torch.optim.SGD, {"lr": 1.0}, param_groups=rules)
    cfg = LRScheduler(warmup_steps=3, decay_ratio=0.0)
    schedulers = build_lr_schedulers(optimizers, cfg, total_steps=10)
    assert len(schedulers) == 3
    assert [g["lr"] for g in optimizers.param_groups] == pytest.approx([0.25, 0.125] * 3)
    train(parts, optimizers, 1)
    schedulers.step()
    assert [g["lr"] for g in optimizers.param_groups] == pytest.approx([0.5, 0.25] * 3)
    assert schedulers.get_last_lr() == pytest.approx(0.5) and schedulers.last_step == 1


def test_resume_keeps_the_step_but_takes_the_lr_from_the_config(caplog):
    cfg = LRScheduler(warmup_steps=2, decay_type="cosine", min_lr_factor=0.1)
    parts = three_parts()
    old = OptimizersContainer(parts, torch.optim.AdamW, {"lr": 1e-3})
    old_sched = build_lr_schedulers(old, cfg, total_steps=10)
    for _ in range(5):
        train(parts, old, 1)
        old_sched.step()
    saved_optim, saved_sched = old.state_dict(), old_sched.state_dict()
    assert saved_sched == {"step": 5}

    new = OptimizersContainer(parts, torch.optim.AdamW, {"lr": 2e-3})  # lr changed in config
    new_sched = build_lr_schedulers(new, cfg, total_steps=10)
    config = ConfigSettings(new)  # as the trainer's CheckpointManager keeps it
    new.load_state_dict(saved_optim)  # torch's contract: the checkpoint's base lr comes back...
    assert {g["initial_lr"] for g in new.param_groups} == {1e-3}
    new_sched.load_state_dict(saved_sched)  # ...the schedule applies its position...
    with caplog.at_level(logging.INFO, logger="components.checkpoint.resume"):
        config.restore()  # ...and the trainer's rule puts the config's base back
    # The base lrs are compared, not the scheduled ones.
    assert [r.getMessage() for r in caplog.records] == [
        "resume: from the config, not the checkpoint: lr 0.001 -> 0.002"
    ]
    expected = 2e-3 * lr_factor(5, cfg, 10)
    assert [g["lr"] for g in new.param_groups] == pytest.approx([expected] * 3)
    assert new_sched.last_step == 5 and new_sched.get_last_lr() == pytest.approx(expected)
    train(parts, new, 1)
    new_sched.step()
    assert new.param_groups[0]["lr"] == pytest.approx(2e-3 * lr_factor(6, cfg, 10))
    with pytest.raises(ValueError, match="step = -1"):
        new_sched.load_state_dict({"step": -1})


def _logged_lrs(
    parts: list[nn.Module],
    optimizers: OptimizersContainer,
    schedulers: LRSchedulersContainer,
    steps: int,
) -> list[float]:
    """The lr `get_last_lr` reports before each of `steps` steps, checked against the groups."""
    lrs = []
    for _ in range(steps):
        lrs.append(schedulers.get_last_lr())
        assert lrs[-1] == optimizers.param_groups[0]["lr"]
        train(parts, optimizers, 1)
        schedulers.step()
    return lrs


def test_constant_lr_is_a_schedule_config():
    """No warmup and no decay keep the configured lr at every step, after a resume too."""
    parts = three_parts()
    optimizers = OptimizersContainer(parts, torch.optim.SGD, {"lr": 0.1})
    cfg = LRScheduler(warmup_steps=0, decay_ratio=0.0)
    schedulers = build_lr_schedulers(optimizers, cfg, total_steps=4)
    assert _logged_lrs(parts, optimizers, schedulers, 4) == [0.1] * 4
    schedulers.load_state_dict({"step": 2})
    assert schedulers.get_last_lr() == 0.1


def test_get_last_lr_is_the_lr_of_the_next_step_after_a_load():
    """Right after a load, the logged lr is the one the next optimizer step uses; stepping on
    from there gives the same lrs as a run that never stopped."""
    cfg = LRScheduler(warmup_steps=3, decay_type="linear", min_lr_factor=0.0)
    parts = three_parts()
    straight = OptimizersContainer(parts, torch.optim.SGD, {"lr": 1.0})
    expected = _logged_lrs(parts, straight, build_lr_schedulers(straight, cfg, 8), 8)
    resumed = OptimizersContainer(parts, torch.optim.SGD, {"lr": 1.0})
    resumed_sched = build_lr_schedulers(resumed, cfg, total_steps=8)
    resumed_sched.load_state_dict({"step": 4})
    got = _logged_lrs(parts, resumed, resumed_sched, 4)
    assert got == pytest.approx(expected[4:])
    assert got[0] == pytest.approx(lr_factor(4, cfg, 8)) and got[0] != expected[0]


def test_dcp_resume_applies_the_config_lr_whatever_the_load_order(tmp_path):
    """DCP loads "lr_scheduler" before "optimizer", whose load keeps this run's lrs (and the
    schedule is re-applied after it), so the first resumed step already uses this run's lr."""
    cfg = LRScheduler(warmup_steps=2, decay_type="cosine", min_lr_factor=0.1)
    parts = three_parts()
    old = OptimizersContainer(parts, torch.optim.AdamW, {"lr": 1e-3})
    old_sched = build_lr_schedulers(old, cfg, total_steps=5)
    _logged_lrs(parts, old, old_sched, 4)
    dcp.save({"optimizer": old, "lr_scheduler": old_sched}, checkpoint_id=tmp_path)

    new = OptimizersContainer(parts, torch.optim.AdamW, {"lr": 2e-3})  # lr and length changed
    new_sched = build_lr_schedulers(new, cfg, total_steps=10)
    dcp.load({"optimizer": new, "lr_scheduler": new_sched}, checkpoint_id=tmp_path)
    expected = 2e-3 * lr_factor(4, cfg, 10)
    assert new_sched.last_step == 4
    assert [g["lr"] for g in new.param_groups] == pytest.approx([expected] * 3)
    assert _logged_lrs(parts, new, new_sched, 2) == pytest.approx(
        [expected, 2e-3 * lr_factor(5, cfg, 10)]
    )
