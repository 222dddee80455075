"""One kernel call across the parts' Adam/AdamW groups: bitwise each optimizer alone."""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from containers import OptimizersContainer, ParamGroupRule
from containers.parts import Precision
from tests.harness import optim_db
from tests.harness.helpers import assert_same, batch, forward, three_parts


class PerOptimizer(Precision):
    """The old apply: each inner optimizer's own `step()`."""

    @property
    def features(self) -> dict[str, str]:
        return {"host_skip": "PerOptimizer (its apply reads no flag)"}

    def apply(self, optimizers, grad_norm=None, max_norm=None) -> None:
        for opt in optimizers:
            opt.step()


class CountOps(TorchDispatchMode):
    """Counts the aten ops run inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _assert_bitwise(grouped: Any, alone: Any, parts: list, ref_parts: list) -> None:
    assert_same(grouped.state_dict(), alone.state_dict())
    for a, b in zip(
        (p for m in parts for p in m.parameters()), (p for m in ref_parts for p in m.parameters())
    ):
        assert torch.equal(a, b)


RULES = [
    ParamGroupRule(r"\.bias$", {"weight_decay": 0.0}),
    ParamGroupRule(r"^head\.weight$", {"lr": 3e-2}),
]

CASES = [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}, "_fused_adamw_"),
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": True}, "_foreach_addcmul_"),
    (
        torch.optim.Adam,
        {"lr": 1e-2, "weight_decay": 0.01, "amsgrad": True, "fused": True},
        "_fused_adam_",
    ),
    (
        torch.optim.Adam,
        {"lr": 1e-2, "weight_decay": 0.01, "maximize": True, "foreach": True},
        "_foreach_addcmul_",
    ),
]

IDS = ["AdamW-fused", "AdamW-foreach", "Adam-fused-amsgrad", "Adam-foreach-maximize"]


def _step(parts: list[nn.Module], container: Any, step: int, no_grad: str | None = None) -> None:
    container.zero_grad()
    forward(parts, batch(step)).square().mean().backward()
    for name, p in (n for part in parts for n in part.named_parameters()):
        if name == no_grad:
            p.grad = None  # not stepped this time, as in torch (its state may start later)
    container.step()


@pytest.mark.parametrize(("cls", "kwargs", "kernel"), CASES, ids=IDS)
def test_one_call_per_bucket_is_bitwise_each_optimizer_stepping_alone(cls, kwargs, kernel):
    parts, ref_parts = three_parts(), three_parts()
    grouped = OptimizersContainer(parts, cls, kwargs, param_groups=RULES, skip_nonfinite=False)
    alone = OptimizersContainer(
        ref_parts, cls, kwargs, param_groups=RULES, skip_nonfinite=False, precision=PerOptimizer()
    )
    assert len(grouped) == 3 and len(grouped.param_groups) == 6
    # mid.weight gets its first gradient (and torch's lazy state) at step 1, embed.bias
    # none at step 3: step counts differ inside one bucket.
    skips = {0: "mid.weight", 3: "embed.bias"}
    for step in range(6):
        if step == 2:
            for c in (grouped, alone):
                # A load replaces torch's group dicts; a write then must reach the step.
                c.load_state_dict(c.state_dict())
                c.param_groups[1]["lr"] = 5e-3  # embed.bias: a bucket of its own now
        with CountOps() as ops:
            _step(parts, grouped, step, skips.get(step))
        # One call per bucket, not per part: defaults, biases, head.weight's lr, and from
        # step 2 embed.bias's lr (at step 3 without a gradient: nothing to call).
        assert ops.calls[kernel] == [3, 3, 4, 3, 4, 4][step]
        _step(ref_parts, alone, step, skips.get(step))
        for a, b in zip(
            (p for m in parts for p in m.parameters()),
            (p for m in ref_parts for p in m.parameters()),
        ):
            assert torch.equal(a, b)
    assert_same(grouped.state_dict(), alone.state_dict())
    assert grouped.optimizers[1].state[parts[1].mid.weight]["step"].item() == 5
    assert grouped.optimizers[0].state[parts[0].embed.bias]["step"].item() == 5


ADAM_DB = [
    (cls, f"{desc}, {kernel}", {**kwargs, kernel: True})
    for cls, desc, kwargs in optim_db.cases()
    if cls in (torch.optim.Adam, torch.optim.AdamW)
    for kernel in ("fused", "foreach")
]


@pytest.mark.parametrize(
    ("cls", "desc", "kwargs"), ADAM_DB, ids=[f"{c.__name__}-{d}" for c, d, _ in ADAM_DB]
)
def test_torch_init_group_keeps_every_adam_configuration_of_optim_db_bitwise(cls, desc, kwargs):
    # The grouped step builds state through torch's private `_init_group`: a torch that
    # changes what it does must show up here, for every configuration torch tests.
    parts, ref_parts = three_parts(), three_parts()
    grouped = OptimizersContainer(parts, cls, kwargs, param_groups=RULES)
    alone = OptimizersContainer(
        ref_parts, cls, kwargs, param_groups=RULES, precision=PerOptimizer()
    )
    for step in range(3):
        with CountOps() as ops:
            _step(parts, grouped, step)
        fused = "_fused_adamw_" if cls is torch.optim.AdamW else "_fused_adam_"
        assert ops.calls[fused if kwargs.get("fused") else "_foreach_addcmul_"] > 0
        _step(ref_parts, alone, step)
    _assert_bitwise(grouped, alone, parts, ref_parts)


def _grouped_and_alone() -> tuple[list, list, OptimizersContainer, OptimizersContainer]:
    """Fused AdamW over two copies of one model: grouped, and each inner optimizer alone."""
    parts, ref_parts = three_parts(), three_parts()
    kwargs = {"lr": 1e-2, "fused": True}
    grouped = OptimizersContainer(parts, torch.optim.AdamW, kwargs)
    alone = OptimizersContainer(ref_parts, torch.optim.AdamW, kwargs, precision=PerOptimizer())
    return parts, ref_parts, grouped, alone


def test_hooks_and_patched_steps_of_inner_optimizers_still_fire_and_stay_bitwise():
    parts, ref_parts, grouped, alone = _grouped_and_alone()
    calls: list[str] = []
    grouped.optimizers[0].register_step_pre_hook(lambda *a: calls.append("pre0"))
    grouped.optimizers[1].register_step_post_hook(lambda *a: calls.append("post1"))
    # A scheduler built on one inner optimizer patches its `step` to note that it ran.
    scheds = [torch.optim.lr_scheduler.StepLR(c.optimizers[2], 1, 0.5) for c in (grouped, alone)]
    with warnings.catch_warnings():
        # Torch warns if the patched step did not run before the scheduler's step.
        warnings.simplefilter("error")
        for step in range(3):
            for p, c, sched in ((parts, grouped, scheds[0]), (ref_parts, alone, scheds[1])):
                _step(p, c, step)
                sched.step()
    assert calls == ["pre0", "post1"] * 3
    assert grouped.optimizers[2].param_groups[0]["lr"] == 1e-2 * 0.5**3
    # A global hook sees the container step, once, as it would one torch optimizer's.
    seen: list[torch.optim.Optimizer] = []
    handle = register_optimizer_step_pre_hook(lambda opt, *a: seen.append(opt))
    try:
        _step(parts, grouped, 3)
        _step(ref_parts, alone, 3)
    finally:
        handle.remove()
    assert seen == [grouped, alone]
    _assert_bitwise(grouped, alone, parts, ref_parts)


def test_torch_lr_schedulers_on_every_inner_optimizer_keep_the_one_call():
    # As train.py's schedulers: a LambdaLR on each inner optimizer patches its `step`.
    parts, ref_parts, grouped, alone = _grouped_and_alone()
    scheds = {
        c: [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5**s) for o in c]
        for c in (grouped, alone)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()"
        for step in range(3):
            with CountOps() as ops:
                _step(parts, grouped, step)
            assert ops.calls["_fused_adamw_"] == 1, step
            _step(ref_parts, alone, step)
            for sched in (*scheds[grouped], *scheds[alone]):
                sched.step()
    assert {g["lr"] for g in grouped.param_groups} == {1e-2 * 0.5**3}
    _assert_bitwise(grouped, alone, parts, ref_parts)


class CountingAdamW(torch.optim.AdamW):
    """A subclass: its step may do more than torch's update, so it must be called."""

    calls = 0

    def step(self, closure=None):
        CountingAdamW.calls += 1
        return super().step(closure)


def test_subclasses_take_their_own_step_beside_grouped_ones():
    parts, ref_parts = three_parts(), three_parts()
    kwargs = {"lr": 1e-2, "fused": True}
    rules = [ParamGroupRule(r"^mid\.", optimizer_cls=CountingAdamW, optimizer_kwargs=kwargs)]
    grouped = OptimizersContainer(parts, torch.optim.AdamW, kwargs, param_groups=rules)
    alone = OptimizersContainer(
        ref_parts, torch.optim.AdamW, kwargs, param_groups=rules, precision=PerOptimizer()
    )
    CountingAdamW.calls = 0
    with CountOps() as ops:
        _step(parts, grouped, 0)
    assert CountingAdamW.calls == 1 and ops.calls["_fused_adamw_"] == 2
    _step(ref_parts, alone, 0)
    assert_same(grouped.state_dict(), alone.state_dict())
