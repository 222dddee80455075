"""Gates: whether a step commits (`TorchFTGate`; default `containers.parts.Gate`)."""

from containers.gate.fault_tolerant import FTOptimizersContainer, TorchFTGate

__all__ = ["FTOptimizersContainer", "TorchFTGate"]
