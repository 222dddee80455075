"""Optimizers added to torch.optim: `ShardedMuon`, `LeanAdam(W)`, `LeanSGD`."""

from containers.optim.lean_adam import LeanAdam, LeanAdamW
from containers.optim.lean_sgd import LeanSGD
from containers.optim.muon import ShardedMuon

__all__ = ["LeanAdam", "LeanAdamW", "LeanSGD", "ShardedMuon"]
