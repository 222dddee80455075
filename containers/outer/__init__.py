"""Outer parts: what follows each committed step, with state of its own (`containers.parts.Outer`).

`DiLoCo`: local inner steps, an outer step on the averaged pseudo-gradient every `sync_steps`.
`LoadBalance`: MoE routing biases moved towards equal expert loads after each committed step.
"""

from containers.outer.diloco import DiLoCo, OtherFragments
from containers.outer.load_balance import LoadBalance

__all__ = ["DiLoCo", "LoadBalance", "OtherFragments"]
