"""`MixedPrecisionSettings`: what `MasterWeights` and `LossScaler` are built from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "GradAccumulationDtype",
    "LossScaling",
    "MasterDtype",
    "MixedPrecisionSettings",
    "ParamDtype",
    "scaling_in_effect",
]

ParamDtype = Literal["bfloat16", "float16"]
MasterDtype = Literal["float32"]
LossScaling = Literal["auto", "dynamic", "static", "none"]
GradAccumulationDtype = Literal["param_dtype", "float32"]


def scaling_in_effect(loss_scaling: str, *, fp16: bool) -> str:
    """`loss_scaling` with "auto" resolved: "dynamic" for float16 weights, else "none"."""
    if loss_scaling != "auto":
        return loss_scaling
    return "dynamic" if fp16 else "none"


@dataclass(frozen=True, kw_only=True)
class MixedPrecisionSettings:
    """Dtypes and loss scaling of a `MasterWeights` precision.

    `loss_scaling` "auto" is "dynamic" for float16 and "none" (a scale of 1) for bfloat16;
    `store_param_remainders` keeps each float32 master as its bfloat16 parameter plus a 16-bit
    remainder; `grad_accumulation_dtype` is what micro-batches' gradients are summed in.
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

    @property
    def scaling(self) -> str:
        """The loss scaling in effect: `loss_scaling`, "auto" resolved by `param_dtype`."""
        return scaling_in_effect(self.loss_scaling, fp16=self.param_dtype == "float16")

    def features(self) -> dict[str, str]:
        """The `containers.rules` features a `MasterWeights` of these settings brings, each
        with what brings it: the one derivation, which the precision and a config check
        (before anything is built) both ask."""
        named = {"masters": "MasterWeights"}
        if self.param_dtype == "float16":
            named["overflow_refusal"] = "MasterWeights' float16 weights"
        if self.scaling != "none":
            named["loss_scaling"] = f"MasterWeights' loss scaling {self.scaling!r}"
        if self.grad_accumulation_dtype == "float32":
            named["fp32_sums"] = "MasterWeights' grad_accumulation_dtype 'float32'"
        if self.scaling == "dynamic" or self.grad_accumulation_dtype == "float32":
            named["host_skip"] = "MasterWeights' dynamic loss scale or fp32 sums"
        return named
