"""`ContainerState`: the container's flat state dict, its load and key check."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from containers.ema import EMA
from containers.parts import PartState
from containers.state.flat import (
    PG,
    STATE,
    UNSAVED_KEYS,
    flatten_into,
    plan_load,
    refuse_other_layout,
)
from containers.state.fsdp1 import FlatShards
from containers.state.initial import derive
from containers.update.forms import coded_codec, in_form_of

__all__ = ["ContainerState"]

logger = logging.getLogger(__name__)


class ContainerState:
    """The state methods of a container (`owner`, whose state hooks it calls)."""

    def __init__(
        self,
        owner: Optimizer,
        optimizers: list[Optimizer],
        fqns: dict[torch.Tensor, str],
        parts: list[PartState],
        keeps_ema: bool,
        flat_shards: FlatShards,
    ) -> None:
        self.owner = owner
        self.optimizers = optimizers
        self._fqns = fqns
        self.parts = parts  # precision, outer part, EMA: saved and loaded in this order
        self.keeps_ema = keeps_ema
        self.flat_shards = flat_shards
        # Keys (and dtypes) of the checkpoint about to load: until then the template's Adam
        # moments take its form (8-bit codes or tensors of its dtype).
        self._checkpoint_keys: Mapping[str, torch.dtype | None] = {}

    def _states(
        self,
        opt: Optimizer,
        materialize: bool,
        keys: Collection[str] | Mapping[str, torch.dtype | None] = frozenset(),
    ) -> tuple[
        dict[torch.Tensor, dict[str, Any]],
        dict[torch.Tensor, frozenset[str]],
        list[tuple[str, str]],
    ]:
        """Live or initial states (moments as `keys` hold them), created names, conversions."""
        params = [p for g in opt.param_groups for p in g["params"]]
        fresh = [p for p in params if not opt.state.get(p)]
        # Unmaterialized derivation is meta-only: cheap enough to learn `created` for all.
        derived = derive(opt, fresh if materialize else params, materialize)
        states = {p: opt.state.get(p) or derived.states[p] for p in params}
        changes: list[tuple[str, str]] = []
        for p, st in states.items() if keys else ():
            states[p], changed = in_form_of(p, st, keys, f"{STATE}.{self._fqns[p]}", materialize)
            changes += changed
        return states, derived.created, changes

    def state_dict(self) -> dict[str, Any]:
        """Parameters not stepped yet hold their initial state: DCP's load template."""
        for hook in self.owner._optimizer_state_dict_pre_hooks.values():
            hook(self.owner)
        flat: dict[str, Any] = {}
        for opt in self.optimizers:
            for p, st in self._states(opt, True, self._checkpoint_keys)[0].items():
                flatten_into(flat, f"{STATE}.{self._fqns[p]}", st)
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    for key, value in group.items():
                        if key != "params" and key not in UNSAVED_KEYS:
                            flat[f"{PG}.{self._fqns[p]}.{key}"] = value
        for part in self.parts:
            flat.update(part.state_dict(self._fqns))
        if self.flat_shards:
            flat = self.flat_shards.export(flat)
        for hook in self.owner._optimizer_state_dict_post_hooks.values():
            result = hook(self.owner, flat)
            if result is not None:
                flat = result
        return flat

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """As torch's, by FQN (`plan_load`); on any problem raise and change nothing."""
        state_dict = dict(state_dict)
        for hook in self.owner._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self.owner, state_dict)
            if result is not None:
                state_dict = result
        sliced: set[str] = set()
        zeros: set[str] = set()
        if self.flat_shards:
            state_dict, sliced, zeros = self.flat_shards.take_local(state_dict)
        taken = [part.take_state(state_dict, self._fqns) for part in self.parts]
        layout, created, changes = [], {}, []
        for opt in self.optimizers:
            states, news, changed = self._states(opt, False, state_dict.keys())
            layout.append(states)
            created.update(news)
            changes += changed
        plans = plan_load(self.optimizers, layout, created, self._fqns, state_dict, zeros, sliced)
        _decode_for(self.optimizers, plans)
        backups = [opt.state_dict() for opt in self.optimizers]
        try:
            for opt, osd in zip(self.optimizers, plans):
                opt.load_state_dict(osd)
        except Exception:
            for opt, backup in zip(self.optimizers, backups):
                opt.load_state_dict(backup)
            raise
        # A checkpoint's load says it with the checkpoint's other conversions (its caller's).
        prepared, self._checkpoint_keys = self._checkpoint_keys, {}
        if not prepared and changes:
            logger.info("optimizer state converted on load: %s", _describe(changes))
        for part, part_taken in zip(self.parts, taken):
            part.load_state(part_taken)
        for hook in self.owner._optimizer_load_state_dict_post_hooks.values():
            hook(self.owner)

    def check_checkpoint_keys(
        self, keys: Collection[str] | Mapping[str, torch.dtype | None]
    ) -> str:
        """Refuse a checkpoint of another layout, else fit `state_dict()` to its keys (entries
        held only sometimes; moments in the checkpoint's form, where keys map to dtypes).
        Returns the Adam moments the load converts, for its log line ("" if none)."""
        fitted = [self._states(opt, False, keys) for opt in self.optimizers]
        refuse_other_layout(self.optimizers, [f[0] for f in fitted], self._fqns, keys)
        dtypes = keys if isinstance(keys, Mapping) else dict.fromkeys(keys)
        self._checkpoint_keys = {k: v for k, v in dtypes.items() if k.startswith(f"{STATE}.")}
        for part in self.parts:
            part.fit_template(keys, self._fqns)
        if not self.keeps_ema and any(k.startswith(f"{EMA}.") for k in keys):
            raise ValueError(
                "the checkpoint holds an EMA of the weights (ema.*) and this container keeps "
                "none, so the load would drop it: keep one ([ema] enable = true)"
            )
        return _describe([change for f in fitted for change in f[2]])

    def forget_checkpoint_keys(self) -> None:
        self._checkpoint_keys = {}
        for part in self.parts:
            part.forget_template()


def _decode_for(optimizers: list[Optimizer], plans: list[dict[str, Any]]) -> None:
    """Decode 8-bit moments in `plans` for optimizers that do not convert them (torch's)."""
    for opt, plan in zip(optimizers, plans):
        if getattr(opt, "converts_codes", False):
            continue
        params = [p for g in opt.param_groups for p in g["params"]]  # (the plan's order)
        for p, state in zip(params, plan["state"].values()):
            for name, value in list(state.items()):
                codec = coded_codec(value)
                if codec is not None:
                    state[name] = codec.to_values(name, value, p)


def _describe(changes: list[tuple[str, str]]) -> str:
    names: dict[str, set[str]] = {}
    for name, how in changes:
        names.setdefault(how, set()).add(name)
    return "; ".join(
        f"{', '.join(sorted(names[how]))} {how} ({sum(h == how for _, h in changes)} tensors)"
        for how in sorted(names)
    )
