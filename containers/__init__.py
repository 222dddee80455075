"""The OptimizersContainer hierarchy: one optimizer object over many model parts."""

from containers.base import OptimizersContainer, ParamGroupRule

__all__ = ["OptimizersContainer", "ParamGroupRule"]
