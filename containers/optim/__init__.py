"""Optimizers added to torch.optim: `ShardedMuon` (Newton-Schulz spread over the sharding
ranks), `LeanAdam(W)` (bf16 or 8-bit moments) and `LeanSGD` (bf16 momentum)."""

from containers.optim.lean_adam import LeanAdam, LeanAdamW
from containers.optim.lean_sgd import LeanSGD
from containers.optim.muon import ShardedMuon

__all__ = ["LeanAdam", "LeanAdamW", "LeanSGD", "ShardedMuon"]
