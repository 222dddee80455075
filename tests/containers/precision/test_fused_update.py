"""Direct tests of containers/fused_update.py: which optimizers it serves, and its kernel.

tests/containers/test_mixed_precision.py checks the compiled path end to end against the container's
eager path; here `fused_adamw_step` is held to torch's own AdamW and Adam. Compiling costs
20-40 s on a CPU, paid once by the module-scoped `compiled_run` fixture: only the tests
named `test_compiled_*` use it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import optim
from torch._dynamo.utils import counters

from containers.precision.fused_update import fused_adamw_step, supports_fused_update


def _one(cls: type, **kwargs: Any) -> torch.optim.Optimizer:
    return cls([torch.nn.Parameter(torch.zeros(2))], lr=0.1, **kwargs)


@pytest.mark.parametrize(
    ("make", "supported"),
    [
        pytest.param(lambda: _one(optim.AdamW), True, id="AdamW"),
        pytest.param(lambda: _one(optim.AdamW, weight_decay=0.0), True, id="AdamW-no-wd"),
        pytest.param(lambda: _one(optim.Adam), True, id="Adam-no-wd"),
        pytest.param(lambda: _one(optim.Adam, weight_decay=0.1), False, id="Adam-wd"),
        pytest.param(lambda: _one(optim.AdamW, amsgrad=True), False, id="AdamW-amsgrad"),
        pytest.param(lambda: _one(optim.Adam, amsgrad=True), False, id="Adam-amsgrad"),
        pytest.param(lambda: _one(optim.AdamW, maximize=True), False, id="AdamW-maximize"),
        pytest.param(lambda: _one(optim.Adam, maximize=True), False, id="Adam-maximize"),
        pytest.param(lambda: _one(optim.AdamW, differentiable=True), False, id="differentiable"),
        pytest.param(lambda: _one(optim.SGD, momentum=0.9), False, id="SGD"),
        pytest.param(lambda: _one(optim.NAdam), False, id="NAdam"),
    ],
)
def test_supports_fused_update(make, supported):
    assert supports_fused_update(make()) is supported


def test_one_group_that_the_kernel_cannot_do_rules_out_the_optimizer():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    opt = optim.Adam([{"params": [a]}, {"params": [b], "weight_decay": 0.1}], lr=0.1)
    assert not supports_fused_update(opt)
    opt = optim.AdamW([{"params": [a]}, {"params": [b], "amsgrad": True}], lr=0.1)
    assert not supports_fused_update(opt)


# -- the compiled kernel against torch's AdamW and Adam --------------------------------------

STEPS = 5
LRS = [1e-2, 3e-3, 2e-2, 5e-3, 1e-2]  # a new lr every step: a scalar input, not a constant
FACTORS = [0.5, 0.25, 1.0, 0.125, 0.3]  # unscale x clip, also new every step
SHAPES = {"AdamW": [(6, 5), (7,)], "Adam": [(3, 4)]}


def _pair(cls: type, shapes: list[tuple[int, ...]], **kwargs: Any) -> tuple[Any, ...]:
    """fp32 masters under the fused step, and identical ones under torch's own `cls`."""
    masters = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    twins = [torch.nn.Parameter(m.detach().clone()) for m in masters]
    fused = cls(masters, lr=LRS[0], betas=(0.8, 0.95), eps=1e-6, **kwargs)
    torch_opt = cls(twins, lr=LRS[0], betas=(0.8, 0.95), eps=1e-6, foreach=False, **kwargs)
    return masters, fused, twins, torch_opt


@pytest.fixture(scope="module")
def compiled_run() -> Iterator[dict[str, Any]]:
    torch.manual_seed(0)
    runs = {
        "AdamW": _pair(optim.AdamW, SHAPES["AdamW"], weight_decay=0.1),
        "Adam": _pair(optim.Adam, SHAPES["Adam"]),
    }
    params = {k: [m.detach().to(torch.bfloat16) for m in r[0]] for k, r in runs.items()}
    graphs = []
    for step in range(STEPS):
        for name, (masters, fused, twins, torch_opt) in runs.items():
            for opt in (fused, torch_opt):
                for group in opt.param_groups:
                    group["lr"] = LRS[step]
            grads = [torch.randn(m.shape).to(torch.bfloat16) for m in masters]
            for twin, g in zip(twins, grads):
                twin.grad = g.float() * FACTORS[step]
            torch_opt.step()
            fused_adamw_step(fused, list(zip(params[name], grads, masters)), FACTORS[step])
        graphs.append(counters["stats"]["unique_graphs"])
    yield {"runs": runs, "params": params, "graphs": graphs}
    # Its shapes count toward dynamo's per-function recompile limit in this process: leave
    # the budget to the tests that come after.
    torch._dynamo.reset()


def test_compiled_step_matches_torch_over_five_steps(compiled_run):
    for name, (masters, fused, twins, torch_opt) in compiled_run["runs"].items():
        for i, (m, t) in enumerate(zip(masters, twins)):
            msg = f"{name} param {i}"
            torch.testing.assert_close(m, t, rtol=1e-6, atol=1e-7, msg=msg)
            for key in ("exp_avg", "exp_avg_sq"):
                got, want = fused.state[m][key], torch_opt.state[t][key]
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9, msg=f"{msg} {key}")
            assert not torch.equal(m, compiled_run["params"][name][i].float())  # it moved


def test_compiled_step_writes_the_bf16_param_as_the_master_rounded(compiled_run):
    for name, (masters, *_) in compiled_run["runs"].items():
        for p, m in zip(compiled_run["params"][name], masters):
            assert p.dtype == torch.bfloat16
            assert torch.equal(p, m.detach().to(torch.bfloat16)), name


def test_compiled_step_keeps_torchs_state_layout(compiled_run):
    for name, (masters, fused, twins, torch_opt) in compiled_run["runs"].items():
        for m, t in zip(masters, twins):
            got, want = fused.state[m], torch_opt.state[t]
            assert list(got) == list(want) == ["step", "exp_avg", "exp_avg_sq"], name
            assert torch.equal(got["step"], want["step"]) and got["step"].item() == STEPS
            for key, value in want.items():
                assert (got[key].dtype, got[key].shape) == (value.dtype, value.shape), key


def test_compiled_step_does_not_recompile_for_new_lr_or_factor(compiled_run):
    first, *later = compiled_run["graphs"]
    assert first >= 1  # compiled (here, or earlier in this process)
    assert later == [first] * len(later)
