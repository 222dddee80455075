"""Gates: whether a step commits, and the gradient exchange across replica groups before it.
`TorchFTGate` is torchft's; the gate that always commits is `containers.parts.Gate`."""

from containers.gate.fault_tolerant import FTOptimizersContainer, TorchFTGate

__all__ = ["FTOptimizersContainer", "TorchFTGate"]
