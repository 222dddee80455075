"""Torch's flat optimizer state-dict format: validate, unflatten, compare settings."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from containers.contract import setting_problems
from containers.norm import all_finite
from containers.tensors import local

STATE = "state"
PG = "param_groups"

# How an optimizer runs, not what it computes: kept the optimizer's own on load.
_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")

# Left out of the flat dict, so runs of either choice write the same keys.
UNSAVED_KEYS = frozenset({"moment_dtype", "compiled"})


def describe_keys(keys: Iterable[str], limit: int = 8) -> str:
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


def state_names(keys: Iterable[str], fqns: Collection[str]) -> dict[str, set[str]]:
    """Each FQN's state names (`exp_avg`, `factors.row`) among flat `keys`; other keys skipped."""
    names: dict[str, set[str]] = {}
    for key in keys:
        if not key.startswith(f"{STATE}."):
            continue
        parts = key.split(".")[1:]
        # The longest FQN prefix: a parameter has no children, so at most one prefix is an FQN.
        for cut in range(len(parts) - 1, 0, -1):
            fqn = ".".join(parts[:cut])
            if fqn in fqns:
                names.setdefault(fqn, set()).add(".".join(parts[cut:]))
                break
    return names


class OtherOptimizerState(ValueError):
    """A checkpoint's optimizer state is another optimizer's (AdamW's for SGD)."""


def refuse_other_layout(
    optimizers: Sequence[Optimizer],
    layout: Sequence[Mapping[torch.Tensor, Mapping[str, Any]]],
    fqns: Mapping[torch.Tensor, str],
    keys: Collection[str],
) -> None:
    """Raise `OtherOptimizerState` if flat `keys` hold another optimizer's state for these
    parameters, told by its state names (Adam and AdamW share theirs, SGD's differ)."""
    fqns_saved = _group_fqns(keys)
    saved = state_names(keys, set(fqns.values()))
    for opt, states in zip(optimizers, layout):
        differ = []
        for p, st in states.items():
            flat: dict[str, Any] = {}
            flatten_into(flat, "", st)
            fqn, ours = fqns[p], {k[1:] for k in flat}
            if fqn in fqns_saved:
                differ.append((fqn, ours) if saved.get(fqn, set()) != ours else None)
        # Only if every parameter differs (a damaged dict gets the key listing instead).
        if differ and all(differ):
            fqn, ours = differ[0]
            cls = type(opt).__name__
            raise OtherOptimizerState(
                f"the checkpoint's optimizer state does not carry over to {cls}: it keeps "
                f"{describe_keys(saved.get(fqn, set()))} per parameter (e.g. {fqn!r}), {cls} "
                f"keeps {describe_keys(ours)}; load it with an optimizer whose state has the "
                "checkpoint's names (the one that wrote it, or Adam <-> AdamW), or start "
                "without this checkpoint"
            )


def plan_load(
    optimizers: Sequence[Optimizer],
    layout: Sequence[Mapping[torch.Tensor, Mapping[str, Any]]],
    created: Mapping[torch.Tensor, Collection[str]],
    fqns: Mapping[torch.Tensor, str],
    flat: Mapping[str, Any],
    zeros: Collection[str] = frozenset(),
    sliced: Collection[str] = frozenset(),
) -> list[dict[str, Any]]:
    """Validate `flat` and unflatten it into one torch state dict per optimizer, by FQN;
    kernel choices and keys `flat` lacks stay the optimizer's own. A `created` state (a name
    the first update creates) still all zeros is a placeholder, dropped. `layout`: each
    parameter's live or initial state; `sliced`: keys holding only this rank's FSDP1 slice,
    `zeros` those whose whole tensor is zeros."""
    expected: dict[str, Any] = {}
    for states in layout:
        for p, st in states.items():
            flatten_into(expected, f"{STATE}.{fqns[p]}", st)
    for group in (g for opt in optimizers for g in opt.param_groups):
        keys = [k for k in group if k != "params" and k not in UNSAVED_KEYS]
        expected.update({f"{PG}.{fqns[p]}.{k}": None for p in group["params"] for k in keys})
    if not isinstance(flat.get(STATE), dict):
        refuse_other_layout(optimizers, layout, fqns, flat.keys())
    # Group settings come from this container: only which parameters they cover must match
    # (a state key names no group, and the empty set is a subset: state keys always count).
    ours, theirs = _group_fqns(expected), _group_fqns(flat)
    missing = {k for k in expected.keys() - flat.keys() if _group_fqns([k]) <= ours - theirs}
    unexpected = {k for k in flat.keys() - expected.keys() if _group_fqns([k]) <= theirs - ours}
    if missing or unexpected:
        unflattened = isinstance(flat.get(STATE), dict)
        hint = (
            " (this looks like an unflattened torch optimizer state dict; pass the "
            "flat FQN-keyed format of state_dict())"
        )
        raise ValueError(
            "optimizer state dict does not match this container"
            f"{hint if unflattened else ''}: missing keys {describe_keys(missing)}; "
            f"unexpected keys {describe_keys(unexpected)}"
        )
    bad = []
    for key, want in expected.items():
        if not isinstance(want, torch.Tensor):
            continue
        got = flat[key]
        if want.dim() == 0:  # a step count: a number or a one-element tensor
            if isinstance(got, torch.Tensor) and got.numel() != 1:
                bad.append(f"{key}: want one number, got shape {tuple(got.shape)}")
            continue
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
        for group in opt.param_groups:
            loaded = _loaded_settings(group, fqns, flat)
            loaded["params"] = []
            for p in group["params"]:
                prefix = f"{STATE}.{fqns[p]}"
                state = unflatten(flat, prefix, states[p])
                for name in created.get(p, ()):
                    key = f"{prefix}.{name}"
                    placeholder = key in zeros if key in sliced else _all_zero(state.get(name))
                    if name in state and placeholder:
                        del state[name]
                loaded["params"].append(len(osd_state))
                osd_state[len(osd_state)] = state
            groups.append(loaded)
        plans.append({"state": osd_state, "param_groups": groups})
    _refuse_bad_values(optimizers, plans, fqns, flat, sharded=bool(sliced))
    return plans


def _refuse_bad_values(
    optimizers: Sequence[Optimizer],
    plans: Sequence[Mapping[str, Any]],
    fqns: Mapping[torch.Tensor, str],
    flat: Mapping[str, Any],
    sharded: bool = False,
) -> None:
    """Raise ValueError for hyperparameters torch's constructors would refuse and for state
    values that are not finite, before anything is loaded: on every rank or on none, where
    the container's parameters are DTensors or `sharded` (FSDP1 slices): its layout, not the
    dict, says the ranks load together (a rank that raised alone would leave the others in
    a collective)."""
    bad = []
    for opt, plan in zip(optimizers, plans):
        for group, loaded in zip(opt.param_groups, plan["param_groups"]):
            where = f"{PG}.{fqns[group['params'][0]]}." if group["params"] else f"{PG}.*."
            bad += [where + problem for problem in setting_problems(loaded)]
    floats = {
        k: v
        for k, v in _state_tensors(flat)
        if isinstance(v, torch.Tensor) and v.is_floating_point()
    }
    world = dist.is_initialized() and (sharded or any(isinstance(p, DTensor) for p in fqns))
    nccl = world and dist.get_backend() == "nccl"  # (its collective needs a CUDA tensor)
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    refused = torch.tensor(float("inf") if bad else 0.0, device=device)  # (one collective)
    if all_finite([refused, *floats.values()], [None] if world else []):
        return
    if bad:
        raise ValueError(
            f"optimizer state dict: {len(bad)} settings torch's optimizers refuse: "
            f"{describe_keys(bad)}; load a checkpoint of this job or fix the values"
        )
    here = [k for k, v in floats.items() if not bool(torch.isfinite(local(v)).all())]
    if not here:
        raise ValueError(
            "optimizer state dict: another rank's part was refused (non-finite values or "
            "settings torch's optimizers refuse: that rank's error names them); nothing was "
            "loaded"
        )
    raise ValueError(
        f"optimizer state dict: non-finite values in {describe_keys(here)}; load an earlier "
        "checkpoint (a step that reached NaN or inf saves none)"
    )


def _state_tensors(flat: Mapping[str, Any]) -> Iterable[tuple[str, Any]]:
    return ((k, v) for k, v in flat.items() if k.startswith(f"{STATE}."))


def _loaded_settings(
    group: dict[str, Any], fqns: Mapping[torch.Tensor, str], flat: Mapping[str, Any]
) -> dict[str, Any]:
    loaded = {k: v for k, v in group.items() if k != "params"}
    names = [fqns[p] for p in group["params"]]
    prefix = f"{PG}.{names[0]}." if names else None
    for key in [k[len(prefix) :] for k in flat if k.startswith(prefix)] if prefix else []:
        if key in _IMPLEMENTATION_KEYS:
            continue
        value = flat[f"{prefix}{key}"]
        for name in names[1:]:
            other = flat.get(f"{PG}.{name}.{key}", value)
            if not _same(other, value):
                raise ValueError(
                    f"optimizer state dict: param_groups.*.{key} is {_show(value)} for "
                    f"{names[0]!r} but {_show(other)} for {name!r}, which share one param "
                    "group here; load a dict whose groups are this container's (same "
                    "param-group rules)"
                )
        own = group.get(key)
        if isinstance(own, torch.Tensor) and not isinstance(value, torch.Tensor):
            value = torch.tensor(value, dtype=own.dtype, device=own.device)  # a tensor lr
        loaded[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return loaded


def setting_changes(
    optimizers: Sequence[Optimizer], before: Sequence[Mapping[str, Any]]
) -> list[str]:
    """How the groups' settings differ from `before`, one line per setting."""
    changes: dict[str, Counter[tuple[str, str]]] = {}
    groups = [(opt, g) for opt in optimizers for g in opt.param_groups]
    for (opt, group), then in zip(groups, before, strict=True):
        n = len(group["params"])
        for name, was in group.items():
            key = "initial_lr" if name == "lr" and "initial_lr" in group else name
            was, now = group[key], then.get(key, group[key])
            skip = ("params", "initial_lr", *_IMPLEMENTATION_KEYS, *UNSAVED_KEYS)
            if name in skip or _same(was, now):
                continue
            if name == "decoupled_weight_decay" and isinstance(opt, torch.optim.Adam):
                # The one setting that tells Adam from AdamW (their state is the same).
                was, now = ("AdamW" if x else "Adam" for x in (was, now))
                name = "optimizer"
            changes.setdefault(name, Counter())[(_show(was), _show(now))] += n
    lines = []
    for key, pairs in changes.items():
        if len(pairs) == 1:
            ((was, now),) = pairs
            lines.append(f"{key} {was} -> {now}")
        else:
            ways = " / ".join(f"{was} -> {now} ({n} params)" for (was, now), n in pairs.items())
            lines.append(f"{key} {ways}")
    return lines


def _group_fqns(keys: Iterable[str]) -> set[str]:
    return {k[len(PG) + 1 :].rsplit(".", 1)[0] for k in keys if k.startswith(f"{PG}.")}


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return repr(value.item())
    return value if isinstance(value, str) else repr(value)


def _all_zero(value: Any) -> bool:
    if not isinstance(value, torch.Tensor):
        return False
    nonzero = value.ne(0).any()
    if isinstance(nonzero, DTensor):
        nonzero = nonzero.full_tensor()  # one shard's answer is not the tensor's
    return not bool(nonzero)


def _shape_of(value: Any) -> str:
    return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def _same(a: Any, b: Any) -> bool:
    """Equal settings (NaN equals NaN here: the same value, which the value check refuses)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return a == b
