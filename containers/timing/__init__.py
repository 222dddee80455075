"""Timings: when units apply. After backward, in `step()`, is `containers.parts.Timing`.
Here: `InBackward` (`in_backward`), each unit inside backward as its gradients become final.
"""

from containers.timing.in_backward import InBackward, OptimizersInBackwardContainer

__all__ = ["InBackward", "OptimizersInBackwardContainer"]
