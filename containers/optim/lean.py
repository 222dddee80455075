"""The per-group `moment_dtype` of optimizers with lean state: a load converts to it, where
torch's would cast all state to the parameters' dtype (`load_keeping_dtypes`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch.optim import Optimizer

from containers.optim.coded_adam import CODED, coded, decode_moment, encode_moment

__all__ = ["MOMENT_DTYPES", "check_moment_dtype", "load_keeping_dtypes", "moment_dtype_of"]

logger = logging.getLogger(__name__)

MOMENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def moment_dtype_of(group: dict[str, Any]) -> torch.dtype:
    """The dtype of a group's elementwise state (for "8bit": that of its uncoded moments)."""
    name = group.get("moment_dtype", "float32")
    return torch.bfloat16 if name == CODED else MOMENT_DTYPES[name]


def check_moment_dtype(group: dict[str, Any], owner: str = "", codes: bool = False) -> None:
    """Raise ValueError unless `moment_dtype` is in `MOMENT_DTYPES` (or "8bit" if `codes`)."""
    name = group.get("moment_dtype", "float32")
    known = [*sorted(MOMENT_DTYPES), *([CODED] if codes else [])]
    if name in known:
        return
    if name == CODED:
        raise ValueError(
            f"{owner} moment_dtype = {name!r}: 8-bit codes are Adam's and AdamW's moments; "
            "use 'bfloat16' (2 bytes a value) for this optimizer's state"
        )
    raise ValueError(
        f"moment_dtype = {name!r}: expected one of {known} (how the optimizer's "
        "elementwise state is kept)"
    )


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
                    moments[p, n] = _kept_as(name, n, v, p)
    rest = {k: {n: v for n, v in st.items() if n not in names} for k, st in state.items()}
    load({**state_dict, "state": rest})
    for group, name in zip(opt.param_groups, own):
        group["moment_dtype"] = name
    for (p, n), v in moments.items():
        opt.state[p][n] = v


def _kept_as(policy: str, name: str, value: Any, p: torch.Tensor) -> Any:
    if policy == CODED:
        if isinstance(value, dict) and coded(p):
            if value["code"].shape != p.shape:
                raise ValueError(
                    f"optimizer state {name}: codes of shape {tuple(value['code'].shape)} for "
                    f"a parameter of shape {tuple(p.shape)}; load the state of this model"
                )
            return {k: v.to(device=p.device) for k, v in value.items()}
        return encode_moment(name, decode_moment(name, value, torch.float32, p), p)
    dtype = MOMENT_DTYPES[policy]
    return decode_moment(name, value, dtype, p).to(device=p.device, dtype=dtype)
