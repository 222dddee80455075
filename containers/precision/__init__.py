"""Precisions: what the inner optimizers step and how gradients reach them.

The fp32 precision (the model's own parameters) is `containers.parts.Precision`. Here:
`MasterWeights` (`master_weights`, its checkpoint state in `master_state`; its container
variant in `mixed_precision`): bf16/fp16 model parameters, fp32 masters, loss scaling
(`loss_scaler`), global clipping, overflow skip, offload. Its update paths: fused Adam/AdamW
groups over flat buffers (`flat_adam`: fused kernel per chunk, or one compiled graph), every
other optimizer per tensor (`eager`); its masters start from the
full-precision init and may step on fp32 gradient sums (`sums`). Their settings, with
their defaults: `MixedPrecisionSettings` (`settings`).
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
