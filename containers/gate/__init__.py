"""Gates: whether a step commits, and the gradient exchange across replica groups before it.

The gate that always commits is `containers.parts.Gate`. Here: `TorchFTGate`
(`fault_tolerant`): torchft's quorum, the average across replica groups, `should_commit`;
`DiLoCoGate` (`diloco`): local inner steps, an outer step on the averaged pseudo-gradient every
`sync_steps`, its outer state container state.
"""

from containers.gate.diloco import DiLoCoGate
from containers.gate.fault_tolerant import FTOptimizersContainer, TorchFTGate

__all__ = ["DiLoCoGate", "FTOptimizersContainer", "TorchFTGate"]
