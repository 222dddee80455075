"""Optimizers the project adds to torch.optim: `ShardedMuon` (`muon`), torch's Muon with the
Newton-Schulz work spread over the ranks that shard the matrices."""

from containers.optim.muon import ShardedMuon

__all__ = ["ShardedMuon"]
