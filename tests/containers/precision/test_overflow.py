"""containers/precision/overflow.py: an update that could overflow fp16 weights is skipped."""

from __future__ import annotations

import math

import pytest
import torch

from containers import MixedPrecisionOptimizersContainer
from containers import MixedPrecisionSettings as MP
from containers.precision.overflow import adam_ratio_bound
from tests.harness.helpers import assert_same, batch, forward, full, three_parts


@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.9, 0.999), (0.5, 0.6), (0.99, 0.9)])
def test_adams_step_never_exceeds_the_bound_and_meets_it_at_the_first_step(betas):
    beta1, beta2 = betas
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(100):  # gradients over six orders of magnitude, in random order
        grads = torch.randn(40, generator=g, dtype=torch.float64)
        grads *= torch.logspace(-3, 3, 40, dtype=torch.float64)[torch.randperm(40, generator=g)]
        m = v = 0.0
        for t, grad in enumerate(grads.tolist(), start=1):
            m, v = beta1 * m + (1 - beta1) * grad, beta2 * v + (1 - beta2) * grad * grad
            ratio = abs(m / (1 - beta1**t)) / math.sqrt(v / (1 - beta2**t))
            worst = max(worst, ratio / adam_ratio_bound(beta1, beta2, t))
    assert worst <= 1.0 + 1e-12
    assert adam_ratio_bound(beta1, beta2, 1) == pytest.approx(1.0)


def _fp16_container(lr: float, **settings):
    parts = [p.to(torch.float16) for p in three_parts()]
    kwargs = {"lr": lr, "weight_decay": 0.1, "fused": True}
    mp = MixedPrecisionOptimizersContainer(
        parts, torch.optim.AdamW, kwargs, max_norm=None,
        settings=MP(param_dtype="float16", initial_scale=1024.0, **settings),
    )  # fmt: skip
    return parts, mp


def _state(parts, mp) -> dict:
    params = {f"param.{i}": full(p) for i, p in enumerate(p for m in parts for p in m.parameters())}
    return {**{k: full(v) for k, v in mp.state_dict().items()}, **params}


def _step(parts, mp, i: int) -> None:
    mp.zero_grad()
    mp.backward(forward(parts, batch(i).half()).float().square().mean())
    mp.step()


def test_a_step_that_could_overflow_fp16_weights_changes_nothing_not_even_the_scale():
    parts, mp = _fp16_container(lr=1e-3)
    _step(parts, mp, 0)
    assert mp.last_step_committed
    before = _state(parts, mp)
    for group in mp.param_groups:
        group["lr"] = 1e5  # one Adam step moves a weight by up to ~lr: past 65504
    _step(parts, mp, 1)
    report = mp.last_report
    assert report.nonfinite and not report.committed and not report.backing_off
    assert "could overflow the float16 weights (AdamW at lr 1e+05" in report.skipped
    for group in mp.param_groups:
        group["lr"] = 1e-3
    assert_same(_state(parts, mp), before)  # masters, moments, scale, weights
    for group in mp.param_groups:
        group["lr"] = 1.0  # far from the limit: applies
    _step(parts, mp, 2)
    assert mp.last_step_committed
    weights = [p for m in parts for p in m.parameters()]
    assert all(bool(p.isfinite().all()) for p in weights)


def test_bf16_weights_are_never_checked():
    parts = [p.to(torch.bfloat16) for p in three_parts()]
    mp = MixedPrecisionOptimizersContainer(
        parts, torch.optim.AdamW, {"lr": 1e5}, settings=MP(loss_scaling="none")
    )
    assert "overflow_refusal" not in mp.precision.features
    mp.zero_grad()
    mp.backward(forward(parts, batch(0).bfloat16()).float().square().mean())
    mp.step()
    assert mp.last_step_committed  # bf16 has fp32's range: 1e5 is no overflow
