"""The update path of each param group: the table of paths and the function that picks one.

A path depends only on the optimizer class, the group's settings, the device and whether
fp32 masters are kept; never on the environment or tensor sizes. Each group logs its path once:

    update path: AdamW[0]: torch
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.optim import Optimizer

__all__ = ["BF16_FUSED_DEVICES", "PATHS", "adam_path", "path_lines", "update_path"]

BF16_FUSED_DEVICES = frozenset({"cuda"})
"""Devices whose fused Adam/AdamW takes bf16 moments beside fp32 parameters; elsewhere bf16
moments are widened into fp32 scratch."""

PATHS = {
    "torch": "torch.optim's own update: fused, foreach or for-loop as the group says (like "
    "Adam/AdamW groups of many inner optimizers in one functional call); any other optimizer's "
    "step()",
    "bf16 fused": "bf16 moments stepped as they are by torch's fused kernel (CUDA)",
    "bf16 scratch": "bf16 moments widened into fp32 scratch a chunk at a time, torch's fused "
    "kernel, rounded back",
    "8bit scratch": "8-bit codes decoded into fp32 scratch a run of rows at a time, torch's "
    "fused kernel, encoded back",
    "compiled": "one inductor graph over the group, each moment in its own dtype",
    "8bit compiled": "one inductor graph decoding, updating and encoding the codes of rows of "
    "whole blocks (others: 8bit scratch)",
    "masters flat": "fp32 masters and moments in flat buffers, torch's fused kernel a chunk at "
    "a time (gradients cast and unscaled into fp32 scratch)",
    "masters flat compiled": "fp32 masters (or remainders) and moments in flat buffers, one "
    "inductor graph over the group",
    "masters per tensor": "fp32 masters stepped by the optimizer's own step(), gradients cast "
    "per tensor",
}
"""Every update path, by the name the `update path` log line gives."""


def update_path(opt: Optimizer, group: dict[str, Any]) -> str:
    """The path (a key of `PATHS`) of `group` of `opt`, stepping its own parameters (under fp32
    masters the precision names it: `MasterWeights.update_path`)."""
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
    """The distinct `update path: <class>[<group index>]: <path>` lines, in order;
    `path_of(opt, index)` names a group's path (`Precision.update_path`)."""
    lines = (
        f"update path: {type(opt).__name__}[{i}]: {path_of(opt, i)}"
        for opt in optimizers
        for i in range(len(opt.param_groups))
    )
    return list(dict.fromkeys(lines))
