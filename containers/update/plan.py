"""Each param group's plan, chosen in one place (`plan_of`): what the kernel steps for its
parameters (a master codec), how its moments are kept (a moment codec), and which driver runs
the update. Its name is the group's `update path` line (ARCHITECTURE.md, "Update plans").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.optim import Optimizer

from containers.tensors import local
from containers.update.codecs import MasterCodec, MomentCodec
from containers.update.driver import adams
from containers.update.forms import MASTER_CODECS, MOMENT_CODECS

__all__ = ["DRIVERS", "Plan", "engine_takes", "path_lines", "plan_of"]

DRIVERS = ("torch", "chunked", "compiled")
"""torch: the optimizer's own step; chunked: `driver.step_slots`; compiled: one graph a
tensor (`compiled.step_compiled`), the chunked driver for what a graph does not take."""


@dataclass(frozen=True)
class Plan:
    """How a param group steps: `driver` over `masters` (a `MASTER_CODECS` key: "param", the
    optimizer's own parameters) and `moments` (a `MOMENT_CODECS` key)."""

    driver: str
    masters: str = "param"
    moments: str = "float32"
    # derived once (a step reads them)
    engine: bool = field(init=False)  # the update engine steps the group, not the optimizer
    compiled: bool = field(init=False)
    master_codec: MasterCodec = field(init=False, repr=False)
    moment_codec: MomentCodec = field(init=False, repr=False)

    def __post_init__(self) -> None:
        derived = {
            "engine": self.driver != "torch",
            "compiled": self.driver == "compiled",
            "master_codec": MASTER_CODECS[self.masters],
            "moment_codec": MOMENT_CODECS[self.moments],
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def name(self) -> str:
        """The `update path` a job logs for the group."""
        kept = [] if self.masters == "param" else [f"{self.masters} masters"]
        if self.engine:
            kept.append(f"{self.moments} moments")
        return ", ".join([self.driver, *kept])


def engine_takes(cls: type[Optimizer], group: dict[str, Any]) -> bool:
    """Whether the engine can step `group` on masters: fused Adam/AdamW without amsgrad, not
    differentiable, its parameters contiguous and on one device."""
    params = group["params"]
    if cls not in adams() or not params or not group.get("fused"):
        return False
    if group.get("amsgrad") or group.get("differentiable"):
        return False
    pieces = [local(p) for p in params]
    return all(t.is_contiguous() for t in pieces) and len({t.device for t in pieces}) == 1


def plan_of(cls: type[Optimizer], group: dict[str, Any], masters: str = "param") -> Plan:
    """The plan of `group` of an optimizer of class `cls`, whose parameters are the model's
    (`masters` "param") or masters kept by a precision ("fp32", "remainders")."""
    moments = group.get("moment_dtype", "float32")
    driver = "compiled" if group.get("compiled") else "chunked"
    if masters == "param":
        lean = cls in adams() and (moments != "float32" or group.get("compiled"))
        return Plan(driver, "param", moments) if lean else Plan("torch")
    if engine_takes(cls, group):
        return Plan(driver, masters, moments)
    return Plan("torch", "fp32", moments)  # the optimizer's own step on fp32 masters


def path_lines(
    optimizers: Sequence[Optimizer], plan: Callable[[Optimizer, int], Plan]
) -> list[str]:
    """The distinct `update path: <class>[<index>]: <plan name>` lines, in order."""
    lines = (
        f"update path: {type(opt).__name__}[{i}]: {plan(opt, i).name}"
        for opt in optimizers
        for i in range(len(opt.param_groups))
    )
    return list(dict.fromkeys(lines))
