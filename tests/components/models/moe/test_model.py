"""The moe Transformer on one process: routing (the bias picks, the scores weigh), token
counts, the shared expert, the output against a token-by-token reference, init and FQNs
across split_model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from components.models.llama.model import split_model
from components.models.moe.model import (
    FLAVORS,
    ModelArgs,
    MoE,
    Transformer,
    load_balance_buffers,
)

TINY = FLAVORS["tiny"]


def _moe(args: ModelArgs = TINY, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(args)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return moe


def _x(tokens: int = 24, dim: int = TINY.dim, seed: int = 1) -> torch.Tensor:
    return torch.randn(tokens, dim, generator=torch.Generator().manual_seed(seed))


def _swiglu(moe: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    w = moe.experts
    return (F.silu(x @ w.w1[e]) * (x @ w.w3[e])) @ w.w2[e]


@torch.no_grad()
def test_the_bias_picks_the_experts_and_the_unbiased_scores_weigh_them():
    moe = _moe()
    x = _x()
    scores = F.softmax(moe.router(x), dim=-1)
    experts, gates = moe.route(x)
    assert torch.equal(experts.sort(-1).values, scores.topk(2, -1).indices.sort(-1).values)
    # A large bias on experts 0 and 3 makes every token pick them, whatever its scores...
    moe.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 10.0]))
    experts, gates = moe.route(x)
    assert torch.equal(experts.sort(-1).values, torch.tensor([[0, 3]]).expand(len(x), 2))
    # ...and weighs them by those scores, without the bias.
    torch.testing.assert_close(gates, scores.gather(-1, experts), rtol=0, atol=0)
    assert (gates < 1).all()


def test_each_training_forward_adds_its_selections_to_the_counts():
    moe = _moe()
    (bias, counts) = load_balance_buffers([moe])[""]
    assert bias is moe.expert_bias and counts is moe.tokens_per_expert
    x = _x(tokens=30)
    experts, _ = moe.route(x)
    once = torch.bincount(experts.flatten(), minlength=4).float()
    moe(x.view(5, 6, -1))
    assert torch.equal(counts, once) and counts.sum() == 30 * TINY.top_k
    moe(x.view(5, 6, -1))
    assert torch.equal(counts, 2 * once)  # added, never reset by the model
    moe.eval()
    moe(x.view(5, 6, -1))
    assert torch.equal(counts, 2 * once)  # evaluation does not count
    assert counts.dtype == bias.dtype == torch.float32 and bias.shape == (TINY.num_experts,)


@pytest.mark.parametrize("shared", [1, 0])
@torch.no_grad()
def test_output_is_the_gated_sum_of_the_chosen_experts_plus_the_shared_one(shared):
    moe = _moe(dataclasses.replace(TINY, shared_experts=shared))
    assert (moe.shared_expert is not None) == bool(shared)
    names = {n for n, _ in moe.named_parameters()}
    assert any(n.startswith("shared_expert.") for n in names) == bool(shared)
    moe.expert_bias.copy_(torch.tensor([0.0, 0.3, -0.2, 0.1]))  # selection differs from scores
    x = _x()
    experts, gates = moe.route(x)
    expected = torch.stack(
        [
            sum(g * _swiglu(moe, int(e), t) for e, g in zip(experts[i], gates[i]))
            for i, t in enumerate(x)
        ]
    )
    if shared:
        expected = expected + moe.shared_expert(x)
    torch.testing.assert_close(moe(x.view(4, 6, -1)).view(24, -1), expected)


def test_experts_are_grouped_3d_weights_and_get_gradients():
    moe = _moe()
    a = TINY
    w = moe.experts
    assert w.w1.shape == w.w3.shape == (a.num_experts, a.dim, a.moe_hidden)
    assert w.w2.shape == (a.num_experts, a.moe_hidden, a.dim)
    assert moe.router.weight.shape == (a.num_experts, a.dim) and moe.router.bias is None
    moe(_x().view(4, 6, -1)).square().sum().backward()
    used = set(moe.route(_x())[0].flatten().tolist())
    for e in range(a.num_experts):
        assert (w.w1.grad[e].abs().sum() > 0) == (e in used)
    assert moe.router.weight.grad.abs().sum() > 0


def test_fqns_survive_the_split_and_the_checkpoint_keeps_the_bias_not_the_counts():
    torch.manual_seed(0)
    model = Transformer(FLAVORS["debug"])
    names = [n for n, _ in model.named_parameters()]
    assert "layers.1.moe.experts.w2" in names and "layers.1.moe.router.weight" in names
    parts = split_model(model, 2)
    assert [n for part in parts for n, _ in part.named_parameters()] == names
    layers = load_balance_buffers(parts)
    assert list(layers) == [f"layers.{i}.moe" for i in range(4)]
    keys = {k for part in parts for k in part.state_dict()}
    assert "layers.3.moe.expert_bias" in keys
    assert not any("tokens_per_expert" in k for k in keys)


def test_init_scales_the_residual_projections_and_zeroes_the_balancing_buffers():
    torch.manual_seed(0)
    a = FLAVORS["debug"]
    model = Transformer(a)
    moe = model.layers["0"].moe
    residual = 0.02 / (2 * a.n_layers) ** 0.5
    assert moe.experts.w2.std().item() == pytest.approx(residual, rel=0.05)
    assert moe.experts.w1.std().item() == pytest.approx(0.02, rel=0.05)
    assert moe.shared_expert.w2.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert not moe.expert_bias.any() and not moe.tokens_per_expert.any()


def test_debug_flavor_activates_about_the_dense_debug_feed_forward():
    from components.models.llama.model import FLAVORS as DENSE

    a, dense = FLAVORS["debug"], DENSE["debug"]
    active = (a.top_k + a.shared_experts) * 3 * a.dim * a.moe_hidden
    assert abs(active / (3 * dense.dim * dense.ffn_hidden) - 1) < 0.05
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, 16))
    logits = Transformer(a)(tokens)
    assert logits.shape == (2, 16, a.vocab_size) and logits.dtype == torch.float32
