"""The state an optimizer gives a parameter before its first step, for DCP load templates:
torch's own `_init_group` on a throwaway gives the values (ASGD's `eta`); a throwaway step on
meta stand-ins finds keys the first update creates (SGD's `momentum_buffer`), which get zero
placeholders a load drops while still zero. Without `_init_group`: the meta step's, zeros.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from containers.tensors import local, shaped_like

__all__ = ["Derived", "derive"]

# Settings that meta tensors cannot run with (kernel flags; maximize negates a sparse
# gradient, which has no meta kernel); none of them changes which state exists.
_SHADOW_OFF = {
    "fused": False,
    "foreach": False,
    "capturable": False,
    "differentiable": False,
    "maximize": False,
}

State = dict[str, Any]


@dataclass
class Derived:
    """Each parameter's start state, and the names its first update creates (placeholders)."""

    states: dict[torch.Tensor, State]
    created: dict[torch.Tensor, frozenset[str]]


def _shadow(
    opt: Optimizer, stand_ins: Mapping[torch.Tensor, torch.Tensor], meta: bool
) -> Optimizer:
    """A throwaway `opt` over stand-ins (meta: kernel flags off, lr 0 wherever it lies)."""
    off = _SHADOW_OFF if meta else {}
    groups = []
    for group in opt.param_groups:
        params = [stand_ins[p] for p in group["params"] if p in stand_ins]
        if params:
            settings = {k: v for k, v in group.items() if k != "params"}
            settings.update({k: v for k, v in off.items() if k in settings})
            if meta and "lr" in settings:
                settings["lr"] = 0.0
            groups.append({**settings, "params": params})
    # `defaults` may hold keys the constructor does not take (AdamW's decoupled_weight_decay).
    accepted = inspect.signature(type(opt)).parameters
    defaults = {k: v for k, v in opt.defaults.items() if k in accepted and k != "params"}
    defaults.update({k: v for k, v in off.items() if k in defaults})
    return type(opt)(groups, **defaults)


def _init_group_states(
    opt: Optimizer, params: list[torch.Tensor], materialize: bool
) -> dict[torch.Tensor, State]:
    """Torch's own start state: `_init_group` on a throwaway over stand-ins of `params`
    (`materialize`: aliases with zero gradients that own no memory; else meta stand-ins placed
    as the parameters, so state not shaped like them takes the whole tensor's shape)."""
    stand_ins = {}
    for p in params:
        if materialize:
            stand_in = p.detach()
            stand_in.grad = shaped_like(local(p).new_zeros(()).expand(local(p).shape), p)
        else:
            stand_in = shaped_like(torch.empty_like(local(p).detach(), device="meta"), p)
            stand_in.grad = shaped_like(torch.empty_like(local(stand_in)), p)
        stand_ins[p] = stand_in
    shadow = _shadow(opt, stand_ins, meta=not materialize)
    init = shadow._init_group  # type: ignore[attr-defined]
    lists = len(inspect.signature(init).parameters) - 1  # the lists it fills, after `group`
    for group in shadow.param_groups:
        init(group, *([] for _ in range(lists)))
    return {p: dict(shadow.state.get(s, {})) for p, s in stand_ins.items()}


def _meta_step_states(opt: Optimizer, params: list[torch.Tensor]) -> dict[torch.Tensor, State]:
    """The state one step gives on meta stand-ins: names, shapes and dtypes."""
    error: Exception | None = None
    for sparse in (False, True):  # SparseAdam takes sparse gradients only
        stand_ins = {}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # sparse meta tensors warn about invariants
                for p in params:
                    meta = torch.empty_like(local(p).detach(), device="meta")
                    meta.grad = _meta_grad(meta, sparse)
                    stand_ins[p] = meta
                shadow = _shadow(opt, stand_ins, meta=True)
                shadow.step()
        except Exception as e:
            error = error or e
            continue
        return {p: dict(shadow.state.get(m, {})) for p, m in stand_ins.items()}
    assert error is not None
    raise error


def _meta_grad(meta: torch.Tensor, sparse: bool) -> torch.Tensor:
    if not sparse:
        return torch.empty_like(meta)
    indices = torch.empty((meta.dim(), 0), dtype=torch.long, device="meta")
    values = torch.empty((0,), dtype=meta.dtype, device="meta")
    return torch.sparse_coo_tensor(indices, values, meta.shape)


def derive(opt: Optimizer, params: list[torch.Tensor], materialize: bool) -> Derived:
    """The start state `opt` would give `params` and the names its first update creates;
    `materialize`: allocated (a state dict), else only shapes and dtypes (validation)."""
    if not params:
        return Derived({}, {})
    exact: dict[torch.Tensor, State] | None = None
    if hasattr(opt, "_init_group"):
        try:
            exact = _init_group_states(opt, params, materialize)
        except (TypeError, RuntimeError, ValueError):
            pass  # a private API of another shape: fall back to the meta step
    try:
        stepped = _meta_step_states(opt, params)
    except Exception as e:
        if exact is None:
            raise RuntimeError(
                f"cannot derive the initial state of {type(opt).__name__} on meta tensors ({e}); "
                "step the optimizer once before taking its state dict"
            ) from e
        stepped = {}  # e.g. ASGD and Adafactor read values (.item()); _init_group has it all
    states, created = {}, {}
    for p in params:
        start = dict(exact[p]) if exact is not None else {}
        added = {k: v for k, v in stepped.get(p, {}).items() if k not in start}
        created[p] = frozenset(added) if exact is not None else frozenset()
        states[p] = {
            **{k: _as_template(p, v, materialize, real=materialize) for k, v in start.items()},
            **{k: _as_template(p, v, materialize, real=False) for k, v in added.items()},
        }
    return Derived(states, created)


def _as_template(p: torch.Tensor, value: Any, materialize: bool, real: bool) -> Any:
    """`value` as a state entry of `p`: kept if `real`, else zeros (or shape/dtype only)."""
    if isinstance(value, Mapping):
        return {k: _as_template(p, v, materialize, real) for k, v in value.items()}
    if real:
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return type(value)(0)
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 0:
        return torch.zeros((), dtype=value.dtype)
    full_shape = local(value).shape == local(p).shape
    if not materialize:
        if full_shape and value.dtype == p.dtype:
            return p.detach()  # shape and placements of the parameter, no new memory
        shape = p.shape if full_shape else value.shape
        return torch.empty(shape, dtype=value.dtype, device="meta")
    if full_shape:
        return torch.zeros_like(p, dtype=value.dtype)
    return torch.zeros(value.shape, dtype=value.dtype, device=local(p).device)
