"""`LossScaler`: the loss scale of fp16 training, with growth, backoff and hysteresis."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from containers.precision.settings import MixedPrecisionSettings, scaling_in_effect

__all__ = ["LossScaler"]


class LossScaler:
    """Loss scale: "dynamic", "static" or 1.0 ("none"); "auto" scales fp16 only."""

    def __init__(
        self, settings: MixedPrecisionSettings | None = None, *, fp16: bool = True
    ) -> None:
        s = settings if settings is not None else MixedPrecisionSettings()
        self.mode = scaling_in_effect(s.loss_scaling, fp16=fp16)
        self.scale = s.initial_scale if self.mode != "none" else 1.0
        self.growth_factor, self.backoff_factor = s.growth_factor, s.backoff_factor
        self.growth_interval, self.hysteresis = s.growth_interval, s.hysteresis
        self.min_scale, self.max_scale = s.min_scale, s.max_scale
        self.good_steps = 0
        self.overflows_left = s.hysteresis

    @property
    def can_back_off(self) -> bool:
        """Whether an overflow may still be the scale's doing (a dynamic scale above its floor)."""
        return self.mode == "dynamic" and self.scale > self.min_scale

    def update(self, overflow: bool) -> None:
        if overflow:
            self.good_steps = 0
            if self.mode != "dynamic":
                return
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.min_scale, self.scale * self.backoff_factor)
                self.overflows_left = self.hysteresis
            return
        if self.mode != "dynamic":
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale = min(self.max_scale, self.scale * self.growth_factor)
            self.good_steps = 0
            self.overflows_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        keys = ("scale", "good_steps", "overflows_left")
        return {k: getattr(self, k) for k in keys}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, type(getattr(self, key))(value))
