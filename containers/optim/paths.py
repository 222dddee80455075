"""The update path of each param group, from the optimizer class, the group's settings and
the device (never the environment or tensor sizes); each group logs it once at its first step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.optim import Optimizer

__all__ = ["BF16_FUSED_DEVICES", "PATHS", "adam_path", "path_lines", "update_path"]

# Whose fused Adam/AdamW takes bf16 moments beside fp32 parameters (elsewhere: fp32 scratch).
BF16_FUSED_DEVICES = frozenset({"cuda"})

# Every update path, by the name its log line gives (what runs: ARCHITECTURE.md's table).
PATHS = (
    "torch",
    "bf16 fused",
    "bf16 scratch",
    "8bit scratch",
    "compiled",
    "8bit compiled",
    "masters flat",
    "masters flat compiled",
    "masters per tensor",
)


def update_path(opt: Optimizer, group: dict[str, Any]) -> str:
    """The path (one of `PATHS`) of `group` of `opt`, stepping its own parameters."""
    from containers.optim.lean_adam import ADAMS  # (lean_adam steps through this module)

    return adam_path(group) if type(opt) in ADAMS else "torch"


def adam_path(group: dict[str, Any]) -> str:
    """The path of an Adam/AdamW group whose parameters the optimizer steps themselves."""
    moments, compiled = group.get("moment_dtype", "float32"), group.get("compiled", False)
    if moments == "8bit":
        return "8bit compiled" if compiled else "8bit scratch"
    if compiled:
        return "compiled"
    if moments == "bfloat16":
        params = group["params"]
        device = params[0].device.type if params else "cpu"
        return "bf16 fused" if device in BF16_FUSED_DEVICES else "bf16 scratch"
    return "torch"


def path_lines(
    optimizers: Sequence[Optimizer], path_of: Callable[[Optimizer, int], str]
) -> list[str]:
    """The distinct `update path: <class>[<index>]: <path>` lines, in order."""
    lines = (
        f"update path: {type(opt).__name__}[{i}]: {path_of(opt, i)}"
        for opt in optimizers
        for i in range(len(opt.param_groups))
    )
    return list(dict.fromkeys(lines))
