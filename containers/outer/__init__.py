"""Outer parts: what follows each committed step, with state of its own."""

from containers.outer.diloco import DiLoCo, OtherFragments
from containers.outer.load_balance import LoadBalance

__all__ = ["DiLoCo", "LoadBalance", "OtherFragments"]
