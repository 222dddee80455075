"""LoadBalance: MoE routing biases moved after committed steps, as container state."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from containers import (
    LoadBalance,
    MixedPrecisionOptimizersContainer,
    OptimizersContainer,
    OptimizersInBackwardContainer,
    TorchFTGate,
)
from tests.containers.gate.test_fault_tolerant import manager  # noqa: F401 (a fixture)
from tests.harness.dist import run_ranks

E, DIM, K = 4, 8, 2


class Router(nn.Module):
    """Top-k routing with a selection bias and a count of selections, as a MoE layer keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, E, bias=False)
        self.register_buffer("expert_bias", torch.zeros(E))
        self.register_buffer("tokens_per_expert", torch.zeros(E), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.gate(x).softmax(dim=-1)
        chosen = (scores + self.expert_bias).topk(K, dim=-1).indices
        self.tokens_per_expert += torch.bincount(chosen.flatten(), minlength=E).float()
        return scores.gather(-1, chosen).sum()


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(Router(), Router())


def _balance(model: nn.Module, coeff: float = 0.1) -> LoadBalance:
    layers = {
        name: (m.expert_bias, m.tokens_per_expert)
        for name, m in model.named_modules()
        if isinstance(m, Router)
    }
    return LoadBalance(layers, coeff)


def _step(opt: OptimizersContainer, model: nn.Module, x: torch.Tensor, loss_scale=1.0) -> None:
    opt.zero_grad()
    loss = sum(m(x) for m in model if isinstance(m, Router)) * loss_scale
    opt.backward(loss)
    opt.step()


def _expected(biases: list[torch.Tensor], counts: list[torch.Tensor], coeff: float):
    return [b + coeff * torch.sign(c.mean() - c) for b, c in zip(biases, counts)]


def _bf16(model: nn.Module) -> nn.Module:
    """The parameters in bf16, the buffers (biases, counts) kept fp32."""
    for p in model.parameters():
        p.data = p.data.bfloat16()
    return model


def _routers(model: nn.Module) -> list[Router]:
    return [m for m in model if isinstance(m, Router)]


def _batch(seed: int) -> torch.Tensor:
    return torch.randn(16, DIM, generator=torch.Generator().manual_seed(seed))


def test_a_committed_step_moves_each_bias_by_the_sign_of_its_load():
    model = _model()
    balance = _balance(model, coeff=0.1)
    opt = OptimizersContainer([model], torch.optim.AdamW, {"lr": 1e-2}, outer=balance)
    for seed in range(3):
        x = _batch(seed)
        opt.zero_grad()
        loss = sum(m(x) for m in _routers(model))
        counts = [m.tokens_per_expert.clone() for m in _routers(model)]
        before = [m.expert_bias.clone() for m in _routers(model)]
        opt.backward(loss)
        opt.step()
        assert opt.last_report.committed
        for bias, want in zip(
            [m.expert_bias for m in _routers(model)], _expected(before, counts, 0.1)
        ):
            torch.testing.assert_close(bias, want, rtol=0, atol=0)
        assert torch.equal(torch.stack(balance.committed), torch.stack(counts))
    imbalance = opt.metrics()["load_imbalance"]
    assert imbalance == max(float(c.max() / c.mean()) for c in counts)
    assert sum(c.sum() for c in counts) == 2 * 16 * K  # every selection counted once


def test_a_nonfinite_step_leaves_biases_and_counts_as_they_were():
    model = _model()
    balance = _balance(model)
    opt = OptimizersContainer([model], torch.optim.AdamW, {"lr": 1e-2}, outer=balance)
    _step(opt, model, _batch(0))
    biases = [m.expert_bias.clone() for m in _routers(model)]
    committed = [c.clone() for c in balance.committed]
    _step(opt, model, _batch(1), loss_scale=math.nan)
    assert opt.last_report.nonfinite and not opt.last_report.committed
    assert all(torch.equal(m.expert_bias, b) for m, b in zip(_routers(model), biases))
    assert all(torch.equal(c, k) for c, k in zip(balance.committed, committed))
    # The skipped step's selections are dropped when the next step begins.
    opt.zero_grad()
    assert all(not m.tokens_per_expert.any() for m in _routers(model))


def test_coeff_zero_counts_and_reports_without_moving_the_biases():
    model = _model()
    balance = _balance(model, coeff=0.0)
    opt = OptimizersContainer([model], torch.optim.AdamW, {"lr": 1e-2}, outer=balance)
    _step(opt, model, _batch(0))
    assert all(not m.expert_bias.any() for m in _routers(model))
    assert opt.metrics()["load_imbalance"] >= 1.0
    assert "LoadBalance(coeff=0.0, 2 layers x 4 experts)" in repr(opt)


@pytest.mark.parametrize("kind", ["in_backward", "mixed_precision"])
def test_other_containers_move_the_biases_alike(kind):
    def build(model):
        balance = _balance(model)
        if kind == "in_backward":
            return OptimizersInBackwardContainer(
                [model], torch.optim.AdamW, {"lr": 1e-2}, outer=balance
            )
        return MixedPrecisionOptimizersContainer(
            [_bf16(model)], torch.optim.AdamW, {"lr": 1e-2}, outer=balance
        )

    model, reference = _model(), _model()
    if kind == "mixed_precision":
        reference = _bf16(reference)
    opt = build(model)
    plain = OptimizersContainer(
        [reference], torch.optim.AdamW, {"lr": 1e-2}, outer=_balance(reference)
    )
    for seed in range(2):
        x = _batch(seed).to(next(model.parameters()).dtype)
        _step(opt, model, x)
        _step(plain, reference, x)
        assert opt.last_report.committed
        for m, r in zip(_routers(model), _routers(reference)):
            assert torch.equal(m.expert_bias, r.expert_bias)
    assert any(m.expert_bias.any() for m in _routers(model))


def test_state_saves_and_resumes_bitwise_through_dcp(tmp_path):
    def build():
        model = _model()
        balance = _balance(model)
        opt = OptimizersContainer([model], torch.optim.AdamW, {"lr": 1e-2}, outer=balance)
        return model, balance, opt

    model, balance, opt = build()
    for seed in range(3):
        _step(opt, model, _batch(seed))
    assert any(k.startswith("load_balance.") for k in opt.state_dict())
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=tmp_path)

    resumed_model, resumed_balance, resumed = build()
    state = {"model": resumed_model.state_dict(), "optimizer": resumed.state_dict()}
    dcp.load(state, checkpoint_id=tmp_path)
    resumed_model.load_state_dict(state["model"])
    resumed.load_state_dict(state["optimizer"])
    assert all(torch.equal(a, b) for a, b in zip(resumed_balance.committed, balance.committed))
    for seed in range(3, 5):
        _step(opt, model, _batch(seed))
        _step(resumed, resumed_model, _batch(seed))
    for m, r in zip(_routers(model), _routers(resumed_model)):
        assert torch.equal(m.expert_bias, r.expert_bias)
        assert torch.equal(m.gate.weight, r.gate.weight)


def test_a_checkpoint_of_other_experts_is_refused_before_anything_changes():
    model = _model()
    balance = _balance(model)
    opt = OptimizersContainer([model], torch.optim.AdamW, {"lr": 1e-2}, outer=balance)
    _step(opt, model, _batch(0))
    state = opt.state_dict()
    key = "load_balance.0.tokens_per_expert"
    state[key] = torch.zeros(E + 1)
    kept = [c.clone() for c in balance.committed]
    with pytest.raises(ValueError, match="not the 4 experts"):
        opt.load_state_dict(state)
    assert all(torch.equal(c, k) for c, k in zip(balance.committed, kept))


def _two_ranks() -> dict[str, torch.Tensor]:
    model = _model()  # same weights on every rank
    balance = _balance(model)
    opt = OptimizersContainer([model], torch.optim.AdamW, {"lr": 1e-2}, outer=balance)
    rank = dist.get_rank()
    x = _batch(100 + rank)  # each rank its own tokens
    opt.zero_grad()
    loss = sum(m(x) for m in _routers(model))
    local_counts = [m.tokens_per_expert.clone() for m in _routers(model)]
    opt.backward(loss)
    opt.step()
    return {
        "local": torch.stack(local_counts),
        "committed": torch.stack(balance.committed),
        "bias": torch.stack([m.expert_bias for m in _routers(model)]),
    }


def test_counts_add_up_over_ranks_and_every_rank_moves_its_biases_alike():
    results = run_ranks(2, _two_ranks)
    total = results[0]["local"] + results[1]["local"]
    assert not torch.equal(results[0]["local"], results[1]["local"])
    for r in results:
        assert torch.equal(r["committed"], total)
    assert torch.equal(results[0]["bias"], results[1]["bias"])
    want = torch.stack(_expected(list(torch.zeros(2, E)), list(total), 0.1))
    assert torch.equal(results[0]["bias"], want)


def test_under_torchft_a_failed_sum_of_the_counts_moves_no_bias(manager):  # noqa: F811
    model = _model()
    balance = LoadBalance(
        {n: (m.expert_bias, m.tokens_per_expert) for n, m in model.named_children()},
        0.1,
        manager=manager,
    )
    opt = OptimizersContainer(
        [model], torch.optim.AdamW, {"lr": 1e-2}, gate=TorchFTGate(manager), outer=balance
    )
    _step(opt, model, _batch(0))  # a real quorum of one group: its own counts
    assert opt.last_report.committed and any(m.expert_bias.any() for m in _routers(model))
    assert all(c.any() for c in balance.committed)
    biases = [m.expert_bias.clone() for m in _routers(model)]
    # The step commits, then the collective that sums the counts fails.
    opt.register_step_post_hook(lambda *_: manager.report_error(RuntimeError("peer died")))
    _step(opt, model, _batch(1))
    assert opt.last_report.committed
    assert all(torch.equal(m.expert_bias, b) for m, b in zip(_routers(model), biases))
    assert all(not c.any() for c in balance.committed)
