"""The OptimizersContainer hierarchy: one optimizer object over many model parts.

One class runs one step pipeline; precision, gate and timing are parts plugged into it
(`containers.parts`). The variants are thin, documented compositions of those parts.
"""

from containers.base import OptimizersContainer, Unit
from containers.fault_tolerant import FTOptimizersContainer, TorchFTGate
from containers.in_backward import InBackward, OptimizersInBackwardContainer
from containers.loss_scaler import LossScaler
from containers.mixed_precision import MasterWeights, MixedPrecisionOptimizersContainer
from containers.muon import ShardedMuon
from containers.param_groups import ParamGroupRule
from containers.parts import Gate, Precision, StepReport, Timing

__all__ = [
    "FTOptimizersContainer",
    "Gate",
    "InBackward",
    "LossScaler",
    "MasterWeights",
    "MixedPrecisionOptimizersContainer",
    "OptimizersContainer",
    "OptimizersInBackwardContainer",
    "ParamGroupRule",
    "Precision",
    "ShardedMuon",
    "StepReport",
    "Timing",
    "TorchFTGate",
    "Unit",
]
