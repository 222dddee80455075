"""Mixed precision: bf16/fp16 model parameters stepped through fp32 masters (`MasterWeights`)."""

from containers.precision.loss_scaler import LossScaler
from containers.precision.master_weights import MasterWeights
from containers.precision.mixed_precision import MixedPrecisionOptimizersContainer, load_planner
from containers.precision.settings import MixedPrecisionSettings

__all__ = [
    "LossScaler",
    "MasterWeights",
    "MixedPrecisionOptimizersContainer",
    "MixedPrecisionSettings",
    "load_planner",
]
