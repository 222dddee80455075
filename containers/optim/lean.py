"""The per-group `moment_dtype` of optimizers with lean state: a load converts to it, where
torch's would cast all state to the parameters' dtype (`load_keeping_dtypes`)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch.optim import Optimizer

from containers.update.forms import MOMENT_CODECS, kept_as

__all__ = ["load_keeping_dtypes", "moment_dtype_of"]


def moment_dtype_of(group: dict[str, Any]) -> torch.dtype:
    """The dtype of a group's elementwise state (for codes: that of its uncoded moments)."""
    return MOMENT_CODECS[group.get("moment_dtype", "float32")].dtype


def load_keeping_dtypes(
    opt: Optimizer,
    state_dict: dict[str, Any],
    names: Collection[str],
    load: Callable[[dict[str, Any]], None],
) -> None:
    """Torch's `load`, the entries `names` set in each group's own `moment_dtype`."""
    own = [g.get("moment_dtype", "float32") for g in opt.param_groups]
    state = state_dict["state"]
    # Convert before changing anything, so a failed conversion leaves `opt` as it was.
    moments = {}
    for group, name, then in zip(opt.param_groups, own, state_dict["param_groups"]):
        for p, k in zip(group["params"], then["params"]):
            for n, v in state.get(k, {}).items():
                if n in names:
                    moments[p, n] = kept_as(name, n, v, p)
    rest = {k: {n: v for n, v in st.items() if n not in names} for k, st in state.items()}
    load({**state_dict, "state": rest})
    for group, name in zip(opt.param_groups, own):
        group["moment_dtype"] = name
    for (p, n), v in moments.items():
        opt.state[p][n] = v
