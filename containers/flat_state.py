"""Helpers for torch's flat optimizer state-dict format, shared by every container."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

STATE = "state"
PG = "param_groups"

# Group keys that would make a throwaway step on meta tensors fail or touch real devices.
# Group keys that say how an optimizer runs, not where training is: a checkpoint written with
# one kernel must load into a run that chose another (or whose device lacks it).
_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")

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


def plan_load(
    optimizers: Sequence[Optimizer],
    layout: Sequence[Mapping[torch.Tensor, Mapping[str, Any]]],
    fqns: Mapping[torch.Tensor, str],
    flat: Mapping[str, Any],
) -> list[dict[str, Any]]:
    """Validate `flat` against `optimizers` and unflatten it into one torch state dict each.

    Args:
        optimizers: the inner optimizers.
        layout: per optimizer, each parameter's state (live or initial), for keys and shapes.
        fqns: each parameter's FQN.
        flat: the flat state dict to load.
    """
    expected: dict[str, Any] = {}
    for states in layout:
        for p, st in states.items():
            flatten_into(expected, f"{STATE}.{fqns[p]}", st)
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                for key in group:
                    if key != "params":
                        expected[f"{PG}.{fqns[p]}.{key}"] = None
    missing = expected.keys() - flat.keys()
    unexpected = flat.keys() - expected.keys()
    if missing or unexpected:
        hint = ""
        if isinstance(flat.get(STATE), dict):
            hint = (
                " (this looks like an unflattened torch optimizer state dict; pass the "
                "flat FQN-keyed format of state_dict())"
            )
        raise ValueError(
            "optimizer state dict does not match this container"
            f"{hint}: missing keys {describe_keys(missing)}; "
            f"unexpected keys {describe_keys(unexpected)}"
        )
    bad = []
    for key, want in expected.items():
        if not isinstance(want, torch.Tensor) or want.dim() == 0:
            continue
        got = flat[key]
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            bad.append(f"{key}: want shape {tuple(want.shape)}, got {_shape_of(got)}")
        elif isinstance(want, DTensor) != isinstance(got, DTensor) and want.device.type != "meta":
            bad.append(f"{key}: want {type(want).__name__}, got {type(got).__name__}")
    if bad:
        raise ValueError(
            f"optimizer state dict has {len(bad)} mismatched tensors: {describe_keys(bad)}"
        )

    plans = []
    for opt, states in zip(optimizers, layout):
        osd_state: dict[int, Any] = {}
        groups = []
        index = 0
        for group in opt.param_groups:
            loaded: dict[str, Any] = {"params": []}
            for p in group["params"]:
                fqn = fqns[p]
                osd_state[index] = unflatten(flat, f"{STATE}.{fqn}", states[p])
                loaded["params"].append(index)
                index += 1
                for key in group:
                    if key == "params":
                        continue
                    value = flat[f"{PG}.{fqn}.{key}"]
                    if key in loaded and not _same(loaded[key], value):
                        raise ValueError(
                            f"param_groups.{fqn}.{key} = {value!r} differs from "
                            f"{loaded[key]!r} of other parameters in its group; the "
                            "checkpoint's groups do not match this container's param_groups"
                        )
                    loaded[key] = value
            for key in _IMPLEMENTATION_KEYS:
                if key in group:
                    loaded[key] = group[key]
            groups.append(loaded)
        plans.append({"state": osd_state, "param_groups": groups})
    return plans


def _shape_of(value: Any) -> str:
    return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b
