"""Helpers for torch's flat optimizer state-dict format, shared by every container."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

STATE = "state"
PG = "param_groups"

# Group keys that would make a throwaway step on meta tensors fail or touch real devices.
_SHADOW_OFF = {"fused": False, "foreach": False, "capturable": False, "differentiable": False}


def describe_keys(keys: Iterable[str], limit: int = 8) -> str:
    """A short, sorted listing of `keys` for error messages."""
    keys = sorted(keys)
    if not keys:
        return "none"
    shown = ", ".join(keys[:limit])
    return f"[{shown}{f', ... and {len(keys) - limit} more' if len(keys) > limit else ''}]"


def flatten_into(out: dict[str, Any], prefix: str, state: Mapping[str, Any]) -> None:
    """Write `state` (possibly nested, as Shampoo's is) under dot-joined keys."""
    for name, value in state.items():
        key = f"{prefix}.{name}"
        if isinstance(value, Mapping):
            flatten_into(out, key, value)
        else:
            out[key] = value


def unflatten(flat: Mapping[str, Any], prefix: str, like: Mapping[str, Any]) -> dict[str, Any]:
    """Read back the nested state that `flatten_into` wrote, shaped like `like`."""
    return {
        name: unflatten(flat, f"{prefix}.{name}", sub)
        if isinstance(sub, Mapping)
        else flat[f"{prefix}.{name}"]
        for name, sub in like.items()
    }


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def initial_states(
    opt: Optimizer, params: list[torch.Tensor], materialize: bool
) -> dict[torch.Tensor, dict[str, Any]]:
    """The state `opt` would give `params` before their first step, without stepping `opt`.

    A throwaway optimizer of the same class steps once on meta-device stand-ins, which
    reveals the names, shapes and dtypes of the state at no memory cost. Initial values are
    zeros (and step 0), the start state of the Adam family and of SGD momentum.

    Args:
        opt: the optimizer that owns `params`.
        params: parameters of `opt` that have no state yet.
        materialize: allocate zero tensors (DTensors for sharded parameters) for a state
            dict; otherwise return tensors that only carry shape and type, for validation.
    """
    wanted = set(params)
    stand_ins: dict[torch.Tensor, torch.Tensor] = {}
    groups = []
    for group in opt.param_groups:
        metas = []
        for p in group["params"]:
            if p in wanted:
                meta = torch.empty_like(_local(p).detach(), device="meta")
                meta.grad = torch.empty_like(meta)
                stand_ins[p] = meta
                metas.append(meta)
        if metas:
            settings = {k: v for k, v in group.items() if k != "params"}
            settings.update({k: v for k, v in _SHADOW_OFF.items() if k in settings})
            if "lr" in settings:
                settings["lr"] = 0.0
            groups.append({**settings, "params": metas})
    # `defaults` may hold keys the constructor does not take (AdamW's decoupled_weight_decay).
    accepted = inspect.signature(type(opt)).parameters
    defaults = {k: v for k, v in opt.defaults.items() if k in accepted and k != "params"}
    defaults.update({k: v for k, v in _SHADOW_OFF.items() if k in defaults})
    try:
        shadow = type(opt)(groups, **defaults)
        shadow.step()
    except Exception as e:
        raise RuntimeError(
            f"cannot derive the initial state of {type(opt).__name__} on meta tensors ({e}); "
            "step the optimizer once before taking its state dict"
        ) from e

    def make(p: torch.Tensor, value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: make(p, v) for k, v in value.items()}
        if isinstance(value, (int, float)):
            return type(value)(0)
        if not isinstance(value, torch.Tensor):
            return value
        if value.dim() == 0:
            return torch.zeros((), dtype=value.dtype)
        if value.shape == _local(p).shape:
            return torch.zeros_like(p, dtype=value.dtype) if materialize else p.detach()
        if materialize:
            return torch.zeros(value.shape, dtype=value.dtype, device=_local(p).device)
        return torch.empty(value.shape, dtype=value.dtype, device="meta")

    return {p: make(p, shadow.state.get(m, {})) for p, m in stand_ins.items()}
