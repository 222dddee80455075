"""The Llama-style Transformer: size, logits, causality, split_model and that it learns."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from components.models.llama.data import ByteTextLoader
from components.models.llama.model import FLAVORS, ModelArgs, Transformer, split_model


def _model(seed: int = 0, args: ModelArgs = FLAVORS["debug"]) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(args)


def _tokens(b: int = 2, s: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(seed))


def _run(parts: list[Transformer], tokens: torch.Tensor) -> torch.Tensor:
    h = tokens
    for part in parts:
        h = part(h)
    return h


def test_debug_flavor_size_and_logits():
    """Parameter count follows the architecture; forward gives float32 (b, s, vocab) logits."""
    a = FLAVORS["debug"]
    model = _model()
    per_block = 4 * a.dim * a.dim + 3 * a.dim * a.ffn_hidden + 2 * a.dim
    expected = 2 * a.vocab_size * a.dim + a.n_layers * per_block + a.dim
    assert sum(p.numel() for p in model.parameters()) == expected
    assert 500_000 < expected < 2_000_000
    assert all(p.dtype == torch.float32 for p in model.parameters())
    logits = model(_tokens(3, 20))
    assert logits.shape == (3, 20, a.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    # Near-uniform at init: the loss is close to ln(vocab).
    loss = F.cross_entropy(logits.flatten(0, 1), _tokens(3, 20, seed=1).flatten())
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5


@torch.no_grad()
def test_changing_a_later_token_leaves_earlier_logits_alone():
    """Causal: logits before position t ignore token t; logits at t and after see it."""
    model = _model()
    x = _tokens(2, 24)
    t = 13
    y = x.clone()
    y[:, t] = (y[:, t] + 1) % 256
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert (a[:, t:] - b[:, t:]).abs().amax(dim=-1).min() > 1e-4


@torch.no_grad()
def test_order_of_earlier_tokens_matters():
    """Rotary positions: permuting the prefix changes later logits even with one layer.

    (With two or more layers the causal mask alone would make order matter.)
    """
    model = _model(args=ModelArgs(n_layers=1))
    x = _tokens(2, 24)
    y = x.clone()
    y[:, :12] = x[:, :12].flip(1)
    assert not torch.equal(x, y)
    a, b = model(x), model(y)
    assert (a[:, 12:] - b[:, 12:]).abs().amax(dim=-1).min() > 1e-4


@pytest.mark.parametrize("num_parts", [1, 2, 3, 4])
@torch.no_grad()
def test_split_keeps_every_fqn_once_and_the_same_logits(num_parts):
    """Parts own disjoint, complete original FQNs and chained give bitwise the whole's logits."""
    model = _model()
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = _tokens()
    expected = model(x)
    parts = split_model(model, num_parts)
    assert len(parts) == num_parts
    names = [n for part in parts for n, _ in part.named_parameters()]
    assert sorted(names) == sorted(whole) and len(names) == len(set(names))
    for part in parts:
        for n, p in part.named_parameters():
            assert torch.equal(p, whole[n]), n
        assert len(part.layers) >= 1
    assert parts[0].tok_embeddings is not None and parts[-1].output is not None
    assert torch.equal(_run(parts, x), expected)


@pytest.mark.parametrize("num_parts", [0, -1, 5])
def test_bad_num_parts_is_refused(num_parts):
    """num_parts must lie in 1..n_layers."""
    with pytest.raises(ValueError, match=rf"num_parts = {num_parts}\b"):
        split_model(_model(), num_parts)


def test_loss_decreases_on_stdlib_bytes():
    """30 AdamW steps on real bytes take the loss well below its starting ln(256)."""
    torch.manual_seed(0)
    model = Transformer(FLAVORS["debug"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = ByteTextLoader(seq_len=64, local_batch_size=4, dp_rank=0, dp_world_size=1, seed=0)
    losses = []
    for _ in range(30):
        x, y = next(loader)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    initial, final = losses[0], sum(losses[-5:]) / 5
    assert initial > 5.0
    assert final < initial - 1.5, losses
