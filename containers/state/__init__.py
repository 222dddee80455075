"""The state format: what a container saves and loads, and how parameters become groups.

- `flat`: torch's flat FQN-keyed format (`state.<fqn>.<name>`, `param_groups.<fqn>.<key>`).
- `initial`: torch's start state of parameters not stepped yet (DCP load templates).
- `param_groups`: `ParamGroupRule`s and the assignment of parameters to inner optimizers.
- `fsdp1`: FSDP1 slices saved and loaded as full-shape DTensors, as FSDP2 writes them.
- `container_state`: the container's `state_dict`, `load_state_dict` and key check.
"""

from containers.state.param_groups import ParamGroupRule

__all__ = ["ParamGroupRule"]
