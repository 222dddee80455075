"""Gates: whether a step commits, and the gradient exchange across replica groups before it.

The gate that always commits is `containers.parts.Gate`. Here: `TorchFTGate`
(`fault_tolerant`): torchft's quorum, the average across replica groups, `should_commit`;
`DiLoCoGate` (`diloco`): local inner steps, an outer step on the averaged pseudo-gradient every
`sync_steps`, its outer state container state. Both refuse a replica group whose settings
differ from the others' with `SettingsMismatch` (`agreement`).
"""

from containers.gate.agreement import SettingsMismatch
from containers.gate.diloco import DiLoCoGate
from containers.gate.fault_tolerant import FTOptimizersContainer, TorchFTGate

__all__ = ["DiLoCoGate", "FTOptimizersContainer", "SettingsMismatch", "TorchFTGate"]
