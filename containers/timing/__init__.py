"""Timings: `InBackward` applies each unit inside backward (default: `containers.parts.Timing`)."""

from containers.timing.in_backward import InBackward, OptimizersInBackwardContainer

__all__ = ["InBackward", "OptimizersInBackwardContainer"]
