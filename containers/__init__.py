"""One torch optimizer over many model parts (mapped in ARCHITECTURE.md)."""

from containers.container import OptimizersContainer, Unit
from containers.ema import ShadowWeights
from containers.gate import FTOptimizersContainer, TorchFTGate
from containers.optim import LeanAdam, LeanAdamW, LeanSGD, ShardedMuon
from containers.outer import DiLoCo, LoadBalance
from containers.parts import Gate, GateLost, Outer, Precision, StepReport, Timing
from containers.precision import (
    LossScaler,
    MasterWeights,
    MixedPrecisionOptimizersContainer,
    MixedPrecisionSettings,
    load_planner,
)
from containers.state import ParamGroupRule
from containers.timing import InBackward, OptimizersInBackwardContainer

__all__ = [
    "DiLoCo",
    "FTOptimizersContainer",
    "Gate",
    "GateLost",
    "InBackward",
    "LeanAdam",
    "LeanAdamW",
    "LeanSGD",
    "LoadBalance",
    "LossScaler",
    "MasterWeights",
    "MixedPrecisionOptimizersContainer",
    "MixedPrecisionSettings",
    "OptimizersContainer",
    "OptimizersInBackwardContainer",
    "Outer",
    "ParamGroupRule",
    "Precision",
    "ShadowWeights",
    "ShardedMuon",
    "StepReport",
    "Timing",
    "TorchFTGate",
    "Unit",
    "load_planner",
]
