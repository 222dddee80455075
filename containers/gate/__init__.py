"""Gates: whether a step commits, and the gradient exchange across replica groups before it.

`TorchFTGate`: torchft's quorum, the average across replica groups, `should_commit`. The gate
that always commits is `containers.parts.Gate`; DiLoCo is an outer part (`containers.outer`).
"""

from containers.gate.fault_tolerant import FTOptimizersContainer, TorchFTGate

__all__ = ["FTOptimizersContainer", "TorchFTGate"]
