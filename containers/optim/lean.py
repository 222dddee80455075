"""What the optimizers with lean state share: the `moment_dtype` a param group keeps its
elementwise state in (Adam's moments, SGD's and Muon's momentum), and a load that keeps it.

`moment_dtype` is a group setting ("float32" or "bfloat16"), so param groups may differ; it is
the optimizer's own storage choice, like its kernel: a load converts to it, never adopts the
dict's. Torch's `Optimizer.load_state_dict` casts every state tensor to its parameter's dtype,
so a resume would hold the whole state in fp32 again; `load_keeping_dtypes` does not.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["MOMENT_DTYPES", "check_moment_dtype", "load_keeping_dtypes", "moment_dtype_of"]

MOMENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The `moment_dtype` names a group may take."""


def moment_dtype_of(group: dict[str, Any]) -> torch.dtype:
    """The dtype a group keeps its elementwise state in (torch's classes: float32)."""
    return MOMENT_DTYPES[group.get("moment_dtype", "float32")]


def check_moment_dtype(group: dict[str, Any]) -> None:
    """Raise ValueError unless the group's `moment_dtype` is one of `MOMENT_DTYPES`."""
    name = group.get("moment_dtype", "float32")
    if name not in MOMENT_DTYPES:
        raise ValueError(
            f"moment_dtype = {name!r}: expected one of {sorted(MOMENT_DTYPES)} (the dtype "
            "the optimizer's elementwise state is kept in)"
        )


def load_keeping_dtypes(
    opt: Optimizer,
    state_dict: dict[str, Any],
    names: Collection[str],
    load: Callable[[dict[str, Any]], None],
) -> None:
    """Torch's load (`load`, the class's `load_state_dict`) with the state entries `names` held
    out of it, then set in each group's own `moment_dtype`, one tensor at a time."""
    own = [g.get("moment_dtype", "float32") for g in opt.param_groups]
    kept = {k: {n: v for n, v in st.items() if n in names} for k, st in state_dict["state"].items()}
    rest = {
        k: {n: v for n, v in st.items() if n not in names} for k, st in state_dict["state"].items()
    }
    load({**state_dict, "state": rest})
    for group, name, then in zip(opt.param_groups, own, state_dict["param_groups"]):
        group["moment_dtype"] = name
        for p, k in zip(group["params"], then["params"]):
            for n, v in kept.get(k, {}).items():
                opt.state[p][n] = v.to(device=p.device, dtype=MOMENT_DTYPES[name])
