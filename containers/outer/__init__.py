"""Outer parts: what follows each committed step, with state of its own (`containers.parts.Outer`).

`DiLoCo`: local inner steps, an outer step on the averaged pseudo-gradient every `sync_steps`.
"""

from containers.outer.diloco import DiLoCo, OtherFragments

__all__ = ["DiLoCo", "OtherFragments"]
