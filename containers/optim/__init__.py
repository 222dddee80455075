"""Optimizers the project adds to torch.optim: `ShardedMuon` (`muon`), torch's Muon with the
Newton-Schulz work spread over the ranks that shard the matrices; `LeanAdam` and `LeanAdamW`
(`lean_adam`), torch's Adam and AdamW with bf16 moments."""

from containers.optim.lean_adam import LeanAdam, LeanAdamW
from containers.optim.muon import ShardedMuon

__all__ = ["LeanAdam", "LeanAdamW", "ShardedMuon"]
