"""A small Llama-style decoder (RMSNorm, rotary attention, SwiGLU) that splits into model parts.

Each part is a `Transformer` that keeps only some of the modules, so every parameter keeps its
original FQN (`layers.3.attention.wq.weight`) in whichever part it lands, as pipeline stages do.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["FLAVORS", "ModelArgs", "Transformer", "split_model"]


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = 256
    ffn_hidden: int = 344
    max_seq_len: int = 1024
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5


FLAVORS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=2, ffn_hidden=172, max_seq_len=256),
    "debug": ModelArgs(),
    "small": ModelArgs(dim=512, n_layers=8, n_heads=8, ffn_hidden=1376, max_seq_len=2048),
}


def _rotary(args: ModelArgs) -> torch.Tensor:
    """cos/sin tables of shape (max_seq_len, head_dim // 2, 2)."""
    head_dim = args.dim // args.n_heads
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(args.max_seq_len).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def _apply_rotary(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    # x: (batch, seq, heads, head_dim); rotate consecutive pairs of channels.
    pairs = x.float().unflatten(-1, (-1, 2))
    cos, sin = rope[: x.shape[1], None, :, 0], rope[: x.shape[1], None, :, 1]
    real = pairs[..., 0] * cos - pairs[..., 1] * sin
    imag = pairs[..., 0] * sin + pairs[..., 1] * cos
    return torch.stack([real, imag], dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism this rank computes only its share of them.
        q, k, v = (w(x).view(b, s, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = _apply_rotary(q, rope), _apply_rotary(k, rope)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Decoder; after `split_model` a part may lack the embedding, some layers or the head.

    A family with other blocks subclasses it: `block` is each layer's class (built from the
    args), and `residual_projections` names the weights (by FQN suffix) whose init shrinks
    with depth.
    """

    block: type[nn.Module] = Block
    residual_projections: tuple[str, ...] = ("wo.weight", "w2.weight")

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.block(args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope", _rotary(args), persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(self.residual_projections):
                # Residual projections scaled down with depth keep the stream's variance flat.
                nn.init.normal_(p, std=std / (2 * self.args.n_layers) ** 0.5)
            else:
                nn.init.normal_(p, std=std)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Token ids (first part) or hidden states (later parts) -> hidden states or logits."""
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h).float()
        return h


def split_model(model: Transformer, num_parts: int) -> list[Transformer]:
    """Split `model` into `num_parts` consecutive parts with balanced layer counts."""
    n = len(model.layers)
    if not 1 <= num_parts <= n:
        raise ValueError(
            f"[model] num_parts = {num_parts}: must be between 1 and the {n} layers of the model"
        )
    if num_parts == 1:
        return [model]
    bounds = [round(i * n / num_parts) for i in range(num_parts + 1)]
    parts = []
    for i in range(num_parts):
        part = copy.deepcopy(model)
        keep = {str(j) for j in range(bounds[i], bounds[i + 1])}
        for key in list(part.layers):
            if key not in keep:
                del part.layers[key]
        if i > 0:
            part.tok_embeddings = None
        if i < num_parts - 1:
            part.norm = None
            part.output = None
        parts.append(part)
    return parts
