"""The state format: what a container saves and loads, and how parameters become groups."""

from containers.state.param_groups import ParamGroupRule

__all__ = ["ParamGroupRule"]
