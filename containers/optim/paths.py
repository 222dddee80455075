"""The update path of each param group: the table of paths and the function that picks one.

A path depends only on the optimizer class, the group's settings, the device and whether
fp32 masters are kept; never on the environment or tensor sizes. Each group logs its path once:

    update path: AdamW[0]: torch
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.optim import Optimizer

from containers.tensors import local

__all__ = ["BF16_FUSED_DEVICES", "PATHS", "adam_path", "flat_group", "path_lines", "update_path"]

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


def update_path(opt: Optimizer, group: dict[str, Any], *, masters: bool = False) -> str:
    """The path (a key of `PATHS`) of `group` of `opt`; `masters`: fp32 masters are kept."""
    from containers.optim.lean_adam import ADAMS  # (lean_adam steps through this module)

    adam = type(opt) in ADAMS
    if masters:
        if adam and flat_group(group):
            return "masters flat compiled" if group.get("compiled") else "masters flat"
        return "masters per tensor"
    return adam_path(group) if adam else "torch"


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


def flat_group(group: dict[str, Any]) -> bool:
    """Whether an Adam/AdamW `group` steps in flat buffers under mixed precision: fused, no
    amsgrad, not differentiable, parameters contiguous and on one device (or the zero-stride
    placeholders of masters kept as remainders)."""
    params = group["params"]
    if not params or group.get("amsgrad") or group.get("differentiable") or not group["fused"]:
        return False
    pieces = [local(p) for p in params]
    dense = all(t.is_contiguous() or not any(t.stride()) for t in pieces)
    return dense and len({t.device for t in pieces}) == 1


def path_lines(optimizers: Sequence[Optimizer], masters: bool = False) -> list[str]:
    """The distinct `update path: <class>[<group index>]: <path>` lines, in order."""
    lines = (
        f"update path: {type(opt).__name__}[{i}]: {update_path(opt, g, masters=masters)}"
        for opt in optimizers
        for i, g in enumerate(opt.param_groups)
    )
    return list(dict.fromkeys(lines))
