"""`MixedPrecisionSettings`: what `MasterWeights` and `LossScaler` are built from.

Owned by the library so it runs without the trainer's config (whose `[mixed_precision]`
section converts into them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "GradAccumulationDtype",
    "LossScaling",
    "MasterDtype",
    "MixedPrecisionSettings",
    "ParamDtype",
]

ParamDtype = Literal["bfloat16", "float16"]
MasterDtype = Literal["float32"]
LossScaling = Literal["auto", "dynamic", "static", "none"]
GradAccumulationDtype = Literal["param_dtype", "float32"]


@dataclass(frozen=True, kw_only=True)
class MixedPrecisionSettings:
    """Dtypes and loss scaling of a `MasterWeights` precision.

    Attributes:
        param_dtype: dtype the model parameters are kept in.
        master_dtype: dtype of the master weights the inner optimizers step.
        loss_scaling: "dynamic" adapts to overflows, "static" keeps `initial_scale`, "none"
            scales by 1; "auto" is "dynamic" for float16 and "none" for bfloat16 (which
            shares float32's exponent range).
        initial_scale: loss scale at the start.
        growth_factor: scale multiplier after `growth_interval` steps without overflow.
        backoff_factor: scale multiplier after an overflow.
        growth_interval: overflow-free steps before the scale grows.
        hysteresis: overflows tolerated before the scale backs off.
        min_scale: lowest loss scale.
        max_scale: highest loss scale.
        store_param_remainders: keep each float32 master as its bfloat16 parameter plus a
            16-bit remainder (bfloat16 parameters only).
        grad_accumulation_dtype: dtype the gradients are summed in over a step's
            micro-batches ("param_dtype": in the parameters' own; "float32": a sum each).
    """

    param_dtype: ParamDtype = "bfloat16"
    master_dtype: MasterDtype = "float32"
    loss_scaling: LossScaling = "auto"
    initial_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    store_param_remainders: bool = False
    grad_accumulation_dtype: GradAccumulationDtype = "param_dtype"
