"""Optimizers the project adds to torch.optim: `ShardedMuon` (`muon`), torch's Muon with the
Newton-Schulz work spread over the ranks that shard the matrices (and its momentum in bf16 if
asked); `LeanAdam` and `LeanAdamW` (`lean_adam`), torch's Adam and AdamW with bf16 or 8-bit
moments (`coded_adam`, `moment_codes`); `LeanSGD` (`lean_sgd`), torch's SGD with bf16
momentum; what they share (`lean`); and the update paths lean state steps through
(`adam_steps`), one of them an inductor graph (`compiled_adam`)."""

from containers.optim.lean_adam import LeanAdam, LeanAdamW
from containers.optim.lean_sgd import LeanSGD
from containers.optim.muon import ShardedMuon

__all__ = ["LeanAdam", "LeanAdamW", "LeanSGD", "ShardedMuon"]
