"""The OptimizersContainer hierarchy: one optimizer object over many model parts."""

from containers.base import OptimizersContainer, ParamGroupRule
from containers.in_backward import OptimizersInBackwardContainer

__all__ = ["OptimizersContainer", "OptimizersInBackwardContainer", "ParamGroupRule"]
