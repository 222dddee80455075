"""Gates: whether a step commits, and the gradient exchange across replica groups before it.

The gate that always commits is `containers.parts.Gate`. Here: `TorchFTGate`
(`fault_tolerant`): torchft's quorum, the average across replica groups, `should_commit`; it
refuses a replica group whose settings differ from the others' with `SettingsMismatch`
(`containers.quorum`). DiLoCo is no gate (every inner step commits): an outer part,
`containers.outer`.
"""

from containers.gate.fault_tolerant import FTOptimizersContainer, TorchFTGate

__all__ = ["FTOptimizersContainer", "TorchFTGate"]
