"""`OptimizersContainer`: one `torch.optim.Optimizer` over the optimizers of many model parts."""

from __future__ import annotations

import re
from collections import ChainMap, OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.profiler import record_function
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from containers.flat_state import (
    PG,
    STATE,
    describe_keys,
    flatten_into,
    initial_states,
    unflatten,
)

__all__ = ["OptimizersContainer", "ParamGroupRule"]

# Group keys that say how an optimizer runs, not where training is: a checkpoint written with
# one kernel must load into a run that chose another (or whose device lacks it).
_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")

# Wrapper segments that torch's DCP state-dict API leaves out of FQNs.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


@dataclass(frozen=True)
class ParamGroupRule:
    """Parameters whose FQN matches `pattern` form a param group with their own settings.

    Args:
        pattern: regular expression searched (`re.search`) in each trainable parameter's FQN.
        overrides: hyperparameters of this group (e.g. ``{"weight_decay": 0.0}``).
        optimizer_cls: optimizer for this group if not the container's; such groups get an
            inner optimizer of their own in each model part.
        optimizer_kwargs: constructor kwargs for `optimizer_cls` (required with it).
    """

    pattern: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    optimizer_cls: type[Optimizer] | None = None
    optimizer_kwargs: Mapping[str, Any] | None = None


def _fqn(name: str) -> str:
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


class OptimizersContainer(Optimizer, Stateful):
    """A `torch.optim.Optimizer` and DCP `Stateful` over the optimizers of many model parts.

    Each model part gets one inner optimizer per optimizer class its parameters use. The
    container keeps the Optimizer contract: `param_groups` are the inner optimizers' live
    groups (LR schedulers and manual lr changes reach the real step), step hooks fire once per
    `step()`, and `state_dict()` is torch's flat FQN-keyed format
    (`StateDictOptions(flatten_optimizer_state_dict=True)`), DTensors kept, so DCP reshards it.

    Args:
        model_parts: modules whose trainable parameters are optimized; frozen ones are skipped.
        optimizer_cls: optimizer for parameters no rule assigns to another class.
        optimizer_kwargs: constructor kwargs of `optimizer_cls`.
        param_groups: rules that form param groups by FQN; each parameter may match at most
            one, and every rule must match at least one parameter.
    """

    steps_in_backward = False
    """True for variants that step during backward (gradients are gone by `step()`)."""

    last_step_committed = True
    """Whether the last `step()` applied; variants that can skip a step set it False."""

    clips_gradients = False
    """True for variants that clip the global gradient norm inside `step()`."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on (variants with loss scaling scale it)."""
        return loss

    def __init__(
        self,
        model_parts: Sequence[nn.Module],
        optimizer_cls: type[Optimizer],
        optimizer_kwargs: Mapping[str, Any],
        *,
        param_groups: Sequence[ParamGroupRule] = (),
    ) -> None:
        self.model_parts = list(model_parts)
        if not self.model_parts or not all(isinstance(m, nn.Module) for m in self.model_parts):
            raise ValueError(
                f"model_parts = {model_parts!r}: expected a non-empty list of nn.Module"
            )
        self.optimizers: list[Optimizer] = []
        self._fqns: dict[torch.Tensor, str] = {}
        self._optimizer_units: list[int] = []
        units = self._units(self._trainable())
        for unit, groups in enumerate(
            self._assign(units, param_groups, optimizer_cls, optimizer_kwargs)
        ):
            for cls, specs in groups.items():
                try:
                    ctor_kwargs = specs[0][1]
                    self.optimizers.append(
                        cls([{"params": ps, **kw} for ps, kw in specs], **ctor_kwargs)
                    )
                except (TypeError, ValueError, RuntimeError) as e:
                    raise ValueError(
                        f"building {cls.__name__} for {units[unit][0][0]!r} and its unit "
                        f"failed: {e}"
                    ) from e
                self._optimizer_units.append(unit)
        if not self.optimizers:
            raise ValueError("model_parts have no trainable parameters; nothing to optimize")
        self.defaults = dict(optimizer_kwargs)
        self._optimizer_step_pre_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_post_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: dict[int, Callable] = OrderedDict()
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"

    def _trainable(self) -> list[list[tuple[str, torch.Tensor]]]:
        """Each part's trainable (FQN, parameter) pairs; a parameter or FQN in two parts is
        an error."""
        owner: dict[torch.Tensor, int] = {}
        fqn_owner: dict[str, int] = {}
        parts = []
        for part_idx, part in enumerate(self.model_parts):
            named = []
            for name, p in part.named_parameters():
                if not p.requires_grad:
                    continue
                fqn = _fqn(name)
                if p in owner:
                    raise ValueError(
                        f"parameter {fqn!r} of model part {part_idx} is also in model part "
                        f"{owner[p]}; a parameter must be owned by exactly one part"
                    )
                if fqn in fqn_owner:
                    raise ValueError(
                        f"FQN {fqn!r} appears in model parts {fqn_owner[fqn]} and {part_idx}; "
                        "checkpoint keys must be unique, so keep the original FQNs per part"
                    )
                owner[p], fqn_owner[fqn] = part_idx, part_idx
                self._fqns[p] = fqn
                named.append((fqn, p))
            parts.append(named)
        return parts

    def _units(
        self, parts: list[list[tuple[str, torch.Tensor]]]
    ) -> list[list[tuple[str, torch.Tensor]]]:
        """Split the parameters into units with inner optimizers of their own: one per part.

        Variants that step finer-grained (per FSDP unit, per module) override this.
        """
        return [named for named in parts if named]

    @staticmethod
    def _assign(
        units: list[list[tuple[str, torch.Tensor]]],
        rules: Sequence[ParamGroupRule],
        default_cls: type[Optimizer],
        default_kwargs: Mapping[str, Any],
    ) -> list[dict[type[Optimizer], list[tuple[list[torch.Tensor], dict[str, Any]]]]]:
        """Map each unit's parameters to (class -> [(params, group kwargs)]) by the rules."""
        compiled = []
        for rule in rules:
            try:
                compiled.append(re.compile(rule.pattern))
            except re.error as e:
                raise ValueError(
                    f"param group pattern {rule.pattern!r} is not a regex: {e}"
                ) from None
            if rule.optimizer_cls is not None and rule.optimizer_kwargs is None:
                raise ValueError(
                    f"param group {rule.pattern!r} names optimizer_cls "
                    f"{rule.optimizer_cls.__name__} without optimizer_kwargs; pass them"
                )
        used = [False] * len(rules)
        assigned = []
        for named in units:
            buckets: list[list[torch.Tensor]] = [[] for _ in range(len(rules) + 1)]
            for fqn, p in named:
                hits = [i for i, rx in enumerate(compiled) if rx.search(fqn)]
                if len(hits) > 1:
                    raise ValueError(
                        f"parameter {fqn!r} matches param group patterns "
                        f"{[rules[i].pattern for i in hits]}; make the patterns disjoint"
                    )
                if hits:
                    used[hits[0]] = True
                buckets[hits[0] + 1 if hits else 0].append(p)
            groups: dict[type[Optimizer], list[tuple[list[torch.Tensor], dict[str, Any]]]] = {}
            for i, params in enumerate(buckets):
                if not params:
                    continue
                rule = rules[i - 1] if i else None
                cls = (rule and rule.optimizer_cls) or default_cls
                kwargs = dict((rule and rule.optimizer_kwargs) or default_kwargs)
                kwargs.update(rule.overrides if rule else {})
                groups.setdefault(cls, []).append((params, kwargs))
            assigned.append(groups)
        unused = [r.pattern for r, u in zip(rules, used) if not u]
        if unused:
            raise ValueError(
                f"param group patterns {unused} match no trainable parameter; fix or remove them"
            )
        return assigned

    # -- the torch.optim.Optimizer contract ------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The inner optimizers' own group dicts: writes to them reach the real step."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> Mapping[torch.Tensor, dict[str, Any]]:  # type: ignore[override]
        """A read-only live view of every inner optimizer's per-parameter state."""
        return MappingProxyType(ChainMap(*(opt.state for opt in self.optimizers)))

    def __iter__(self) -> Iterator[Optimizer]:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    def __repr__(self) -> str:
        inner = ", ".join(type(o).__name__ for o in self.optimizers)
        return f"{type(self).__name__}([{inner}])"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} owns the parameters of its model parts; add parameters "
            "to a model part and build a new container instead of add_param_group"
        )

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step every inner optimizer once; step hooks fire once around the whole step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        args: tuple[Any, ...] = ()
        kwargs: dict[str, Any] = {}
        with record_function(f"Optimizer.step#{type(self).__name__}.step"):
            self.last_step_committed = self._should_step()
            if not self.last_step_committed:
                return loss
            for hook in list(self._optimizer_step_pre_hooks.values()):
                result = hook(self, args, kwargs)
                if result is not None:
                    if not (isinstance(result, tuple) and len(result) == 2):
                        raise RuntimeError(
                            f"step pre hook {hook!r} must return None or (args, kwargs), "
                            f"not {result!r}"
                        )
                    args, kwargs = result
            self._step()
            for hook in list(self._optimizer_step_post_hooks.values()):
                hook(self, args, kwargs)
        return loss

    def _should_step(self) -> bool:
        """Whether this step applies; variants that can skip a step override it."""
        return True

    def _step(self) -> None:
        """The optimizer work of one step; variants override this, never `step`."""
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        with record_function(self._zero_grad_profile_name):
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=set_to_none)

    # -- flat FQN-keyed state dict -----------------------------------------------------------

    def _states(self, opt: Optimizer, materialize: bool) -> dict[torch.Tensor, dict[str, Any]]:
        """Each parameter's live state, or its optimizer's initial state if it has none yet."""
        params = [p for g in opt.param_groups for p in g["params"]]
        fresh = [p for p in params if not opt.state.get(p)]
        init = initial_states(opt, fresh, materialize) if fresh else {}
        return {p: opt.state.get(p) or init[p] for p in params}

    def state_dict(self) -> dict[str, Any]:
        """Torch's flat optimizer state dict: `state.<fqn>.<name>`, `param_groups.<fqn>.<key>`.

        Parameters that have not stepped yet appear with their optimizer's initial state
        (zeros, step 0), built without running a step, so the dict always covers every
        trainable parameter and serves as the template that DCP loads into.
        """
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        flat: dict[str, Any] = {}
        for opt in self.optimizers:
            states = self._states(opt, materialize=True)
            for p, st in states.items():
                flatten_into(flat, f"{STATE}.{self._fqns[p]}", st)
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    for key, value in group.items():
                        if key != "params":
                            flat[f"{PG}.{self._fqns[p]}.{key}"] = value
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, flat)
            if result is not None:
                flat = result
        return flat

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a flat state dict; on any problem raise and leave the optimizer as it was."""
        state_dict = dict(state_dict)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        plans = self._plan_load(state_dict)
        backups = [opt.state_dict() for opt in self.optimizers]
        try:
            for opt, osd in zip(self.optimizers, plans):
                opt.load_state_dict(osd)
        except Exception:
            for opt, backup in zip(self.optimizers, backups):
                opt.load_state_dict(backup)
            raise
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _plan_load(self, flat: dict[str, Any]) -> list[dict[str, Any]]:
        """Validate `flat` against this container and unflatten it per inner optimizer."""
        layout = [self._states(opt, materialize=False) for opt in self.optimizers]
        expected: dict[str, Any] = {}
        for states in layout:
            for p, st in states.items():
                flatten_into(expected, f"{STATE}.{self._fqns[p]}", st)
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    for key in group:
                        if key != "params":
                            expected[f"{PG}.{self._fqns[p]}.{key}"] = None
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
            elif (
                isinstance(want, DTensor) != isinstance(got, DTensor) and want.device.type != "meta"
            ):
                bad.append(f"{key}: want {type(want).__name__}, got {type(got).__name__}")
        if bad:
            raise ValueError(
                f"optimizer state dict has {len(bad)} mismatched tensors: {describe_keys(bad)}"
            )

        plans = []
        for opt, states in zip(self.optimizers, layout):
            osd_state: dict[int, Any] = {}
            groups = []
            index = 0
            for group in opt.param_groups:
                loaded: dict[str, Any] = {"params": []}
                for p in group["params"]:
                    fqn = self._fqns[p]
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
