"""A Llama-style decoder whose feed-forward is a mixture of experts (torchtitan's MoE).

Each block keeps llama's attention and norms; its `moe` routes every token to `top_k` of
`num_experts` routed experts (token choice over softmax scores), held as grouped 3-D weights,
and adds an optional shared expert that every token goes through. DeepSeek-V3's aux-loss-free
load balancing lives in two buffers of each `MoE`: `expert_bias`, added to the scores for the
top-k selection only (the gate weights come from the unbiased scores), and `tokens_per_expert`,
to which each training forward adds the selections each expert received on this rank. Who
moves the bias and zeroes the counts is outside the model (`containers.LoadBalance`).

Under expert parallelism (`components.models.moe.parallelize`) each rank holds
`num_experts / ep` of the experts; the tokens routed to the others travel there and back by
all-to-all over the ep group (`MoE.ep_group`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from components.models.llama.model import Attention, FeedForward
from components.models.llama.model import ModelArgs as DenseArgs
from components.models.llama.model import Transformer as DenseTransformer

__all__ = [
    "FLAVORS",
    "GroupedExperts",
    "MoE",
    "ModelArgs",
    "Transformer",
    "load_balance_buffers",
]


@dataclass(frozen=True)
class ModelArgs(DenseArgs):
    """llama's args (`ffn_hidden` unused) and the mixture's."""

    num_experts: int = 8
    top_k: int = 2
    moe_hidden: int = 112
    """Hidden units of each routed expert's SwiGLU."""
    shared_experts: int = 1
    """Shared experts every token goes through, as one SwiGLU of `shared_experts x
    moe_hidden` hidden units; 0: none."""


FLAVORS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=2, max_seq_len=256, num_experts=4, moe_hidden=32),
    # Active feed-forward parameters (2 routed + 1 shared expert of 112) ~ llama debug's 344.
    "debug": ModelArgs(),
}


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts as grouped weights: w1, w3 `[E, dim, hidden]`, w2
    `[E, hidden, dim]` (under expert parallelism, DTensors split on dim 0: this rank's
    experts are its local rows)."""

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden))

    def forward(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """`x`: tokens sorted by local expert, `counts[i]` of them for the i-th."""
        w1, w2, w3 = (
            (w.to_local() if isinstance(w, DTensor) else w).unbind(0)
            for w in (self.w1, self.w2, self.w3)
        )
        pieces = torch.split(x, list(counts))
        out = [(F.silu(h @ a) * (h @ c)) @ b for h, a, b, c in zip(pieces, w1, w2, w3, strict=True)]
        return torch.cat(out)


class _AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` with rows split by `outputs`/`inputs`; backward sends the
    gradients back the way the rows came."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        outputs: list[int],
        inputs: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (outputs, inputs), group  # type: ignore[attr-defined]
        return _all_to_all(x, outputs, inputs, group)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        outputs, inputs = ctx.splits  # type: ignore[attr-defined]
        return _all_to_all(grad, inputs, outputs, ctx.group), None, None, None  # type: ignore[attr-defined]


def _all_to_all(
    x: torch.Tensor, outputs: list[int], inputs: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = x.new_empty((sum(outputs), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), outputs, inputs, group=group)
    return out


class MoE(nn.Module):
    """Router, routed experts, optional shared expert, and the load-balancing buffers."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.top_k
        self.router = nn.Linear(args.dim, args.num_experts, bias=False)
        self.experts = GroupedExperts(args.dim, args.moe_hidden, args.num_experts)
        self.shared_expert: FeedForward | None = None
        if args.shared_experts:
            hidden = args.shared_experts * args.moe_hidden
            self.shared_expert = FeedForward(dataclasses.replace(args, ffn_hidden=hidden))
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        self.ep_group: dist.ProcessGroup | None = None
        """The ranks the experts are split over (set by expert parallelism); None: all here."""

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's `top_k` experts, picked by score + bias, and their unbiased scores
        (the gate weights), both `(tokens, top_k)`."""
        scores = F.softmax(self.router(x).float(), dim=-1)
        _, experts = torch.topk(scores + self.expert_bias, self.top_k, dim=-1)
        return experts, scores.gather(-1, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        experts, gates = self.route(x)
        counts = torch.bincount(experts.flatten(), minlength=self.expert_bias.numel())
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
        order = torch.argsort(experts.flatten(), stable=True)
        tokens = order // self.top_k
        routed = x[tokens]
        if self.ep_group is None:
            out = self.experts(routed, counts.tolist())
        else:
            out = self._across_ranks(routed, counts)
        weighted = (out.float() * gates.flatten()[order, None]).to(x.dtype)
        y = torch.zeros_like(x).index_add_(0, tokens, weighted)
        if self.shared_expert is not None:
            y = y + self.shared_expert(x)
        return y.view(shape)

    def _across_ranks(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for `routed` (sorted by expert, `counts` per expert), each
        row computed on the rank that holds its expert."""
        group = self.ep_group
        ranks = dist.get_world_size(group)
        # received[j, i]: rows rank j sends for this rank's i-th expert.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        sent = counts.view(ranks, -1).sum(1).tolist()
        received = received.view(ranks, -1)
        rows = _AllToAll.apply(routed, received.sum(1).tolist(), sent, group)
        # Rows arrive by source rank, then expert; the experts take them by expert.
        starts = torch.cumsum(received.flatten(), 0) - received.flatten()
        starts, sizes = starts.view_as(received).t().tolist(), received.t().tolist()
        by_expert = torch.cat(
            [
                torch.arange(start, start + size)
                for first, n in zip(starts, sizes)
                for start, size in zip(first, n)
            ]
        ).to(rows.device)
        out = self.experts(rows[by_expert], received.sum(0).tolist())
        back = torch.empty_like(out).index_copy_(0, by_expert, out)
        return _AllToAll.apply(back, sent, received.sum(1).tolist(), group)


class Block(nn.Module):
    """llama's block with a mixture of experts (`moe`) as its feed-forward."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe = MoE(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.moe(self.ffn_norm(x))


class Transformer(DenseTransformer):
    """llama's decoder (embedding, rotary table, norm, head, `split_model`) of MoE blocks."""

    block = Block
    residual_projections = ("wo.weight", "w2.weight", "experts.w2")


def load_balance_buffers(
    model_parts: Sequence[nn.Module],
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each MoE layer's FQN (e.g. "layers.1.moe") -> its (expert_bias, tokens_per_expert):
    the tensors its forward reads and adds to."""
    return {
        name: (module.expert_bias, module.tokens_per_expert)
        for part in model_parts
        for name, module in part.named_modules()
        if isinstance(module, MoE)
    }
