"""containers/master_step.py: stepping chunk by chunk is the one step, bitwise."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from containers.precision.eager import step_masters

SHAPES = [(5, 3), (7,), (2, 2, 2), (11,), (1,), (4, 6)]
FACTOR = 0.3  # unscale x clip: not a power of two, so a different rounding would show


class Quirky(torch.optim.AdamW):
    """A subclass: not known to be per-parameter, so it must step once over all its tensors."""

    def step(self, closure: Any = None) -> Any:
        self.calls = getattr(self, "calls", 0) + 1
        return super().step(closure)


def _setup(seed: int) -> tuple[list, list]:
    torch.manual_seed(seed)
    params = [torch.randn(s).to(torch.bfloat16) for s in SHAPES]
    masters = [torch.nn.Parameter(p.float()) for p in params]
    optimizers = [
        torch.optim.AdamW(masters[:2], lr=1e-2, weight_decay=0.1, fused=True),
        torch.optim.SGD(masters[2:4], lr=0.5, momentum=0.9),
        Quirky(masters[4:], lr=1e-2),
    ]
    return params, masters, optimizers


def _reference(params, masters, optimizers, grads) -> None:
    """The plain step: every gradient to fp32, multiplied, stepped, written back."""
    for m, g in zip(masters, grads):
        m.grad = g.float() * FACTOR
    for opt in optimizers:
        opt.step()
    for p, m in zip(params, masters):
        p.copy_(m.detach())


@pytest.mark.parametrize("chunk_numel", [1, 16, 1 << 20])
def test_chunked_steps_equal_the_plain_step_bitwise_and_free_gradients(chunk_numel):
    (params, masters, optimizers), ref = _setup(0), _setup(0)
    for _ in range(3):
        grads = [torch.randn(s).to(torch.bfloat16) for s in SHAPES]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        pairs = [[(params[i], masters[i]) for i in idx] for idx in ([0, 1], [2, 3], [4, 5])]
        step_masters(optimizers, pairs, FACTOR, torch.float32, chunk_numel=chunk_numel)
        _reference(*ref, grads)
        assert all(p.grad is None for p in params)  # dropped once cast
        assert all(m.grad is None for m in masters)
    assert optimizers[2].calls == 3  # once per step, however small the chunks
    for i, (p, m, rp, rm) in enumerate(zip(params, masters, ref[0], ref[1])):
        assert torch.equal(m, rm) and torch.equal(p, rp), i
        assert not torch.equal(m, _setup(0)[1][i]), i  # it moved
    for opt, ropt in zip(optimizers, ref[2]):
        for m, rm in zip(opt.param_groups[0]["params"], ropt.param_groups[0]["params"]):
            for key, value in ropt.state[rm].items():
                assert torch.equal(opt.state[m][key], value), key
