"""The OptimizersContainer hierarchy: one optimizer object over many model parts."""

from containers.base import OptimizersContainer, ParamGroupRule
from containers.fault_tolerant import FTOptimizersContainer
from containers.in_backward import OptimizersInBackwardContainer
from containers.mixed_precision import LossScaler, MixedPrecisionOptimizersContainer

__all__ = [
    "FTOptimizersContainer",
    "LossScaler",
    "MixedPrecisionOptimizersContainer",
    "OptimizersContainer",
    "OptimizersInBackwardContainer",
    "ParamGroupRule",
]
