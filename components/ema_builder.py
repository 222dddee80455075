"""`build_ema`: the `[ema]` section -> the container's `ShadowWeights` (or None)."""

from __future__ import annotations

from config import EMA
from containers import ShadowWeights

__all__ = ["build_ema"]


def build_ema(cfg: EMA) -> ShadowWeights | None:
    """The EMA of the weights that `[ema]` asks for; None where it is off. A `half_life`
    (steps) gives the decay of each update: 0.5 ** (update_every_n_steps / half_life)."""
    if not cfg.enable:
        return None
    decay = 0.5 ** (cfg.update_every_n_steps / cfg.half_life) if cfg.half_life else cfg.decay
    return ShadowWeights(
        decay, update_every_n_steps=cfg.update_every_n_steps, start_step=cfg.start_step
    )
