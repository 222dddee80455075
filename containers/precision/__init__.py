"""Mixed precision: bf16/fp16 model parameters stepped through fp32 masters (`MasterWeights`).

Also: loss scaling (`loss_scaler`), flat Adam/AdamW groups (`flat_adam`), the per-tensor path
of other optimizers (`eager`), fp32 gradient sums (`sums`) and `MixedPrecisionSettings`. The
fp32 precision is `containers.parts.Precision`.
"""

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
