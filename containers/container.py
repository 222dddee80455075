"""`OptimizersContainer`: one step pipeline (ARCHITECTURE.md, "One step") into which every
variant plugs its parts. A non-finite loss given to `backward()` turns every gradient it
reaches into NaN (no host sync), so the one finite check catches it too."""

from __future__ import annotations

import contextlib
import logging
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.profiler import record_function
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from torch.optim import optimizer as torch_optimizer

from containers.contract import NON_NEGATIVE, StateView, defaults_of
from containers.ema import ShadowWeights
from containers.norm import GlobalNorm, all_finite, nonfinite_flag
from containers.parts import Gate, Outer, Precision, StepReport, Timing, step_report
from containers.rules import refuse
from containers.state.container_state import ContainerState
from containers.state.fsdp1 import FlatShards, refuse_coded, refuse_optimizers
from containers.state.param_groups import ParamGroupRule, assign, trainable
from containers.update.driver import kernel_skips
from containers.update.plan import path_lines

__all__ = ["KERNEL_SKIP_DEVICES", "Decision", "OptimizersContainer", "ParamGroupRule", "Unit"]

logger = logging.getLogger(__name__)


# Where a host sync stalls the device; on CPU it is free and torch's found_inf path slower.
KERNEL_SKIP_DEVICES = frozenset({"cuda"})


class Decision:
    """Whether a step's gradients may apply (`local_norm`: this rank's, agreed after)."""

    def __init__(
        self, precision: Precision, global_norm: GlobalNorm, device: torch.device, local_norm: bool
    ) -> None:
        self.precision = precision
        self.may_refuse = "overflow_refusal" in precision.features
        self.host_skip = "host_skip" in precision.features
        self.global_norm = global_norm
        self.device = device
        self.local_norm = local_norm

    def kernels_may_skip(self, optimizers: Sequence[Optimizer]) -> bool:
        """Whether the precision and device let `optimizers`' kernels take the skip."""
        return (
            self.device.type in KERNEL_SKIP_DEVICES
            and not self.may_refuse
            and not self.host_skip
            and kernel_skips(optimizers)
        )

    def read(
        self, report: StepReport, found: torch.Tensor | None, norm: torch.Tensor | None
    ) -> StepReport:
        """`report` completed by the flag (and norm) a step left to the kernels (one sync)."""
        if found is None:
            return report
        value, skip = torch.stack([norm, found]).tolist() if norm is not None else (None, found)
        return self.nonfinite(value) if skip else replace(report, grad_norm=value)

    def nonfinite(self, value: float | None) -> StepReport:
        return step_report(
            self.precision,
            committed=False,
            skipped="non-finite loss or gradients"
            + (f" (global norm {value})" if value is not None else ""),
            nonfinite=True,
            grad_norm=value,
        )

    def refusal(self, optimizers: Sequence[Optimizer]) -> str | None:
        """`Precision.refusal`, agreed by the world (ranks hold different shards)."""
        if not self.may_refuse:
            return None
        why = self.precision.refusal(optimizers)
        if dist.is_initialized() and dist.get_world_size() > 1:
            found = torch.tensor(float(why is not None), device=self.device)
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
            if found and why is None:
                why = "another rank's update could overflow its float16 weights"
        return why

    def measure(
        self, params: list[torch.Tensor], skip_nonfinite: bool, exact: bool = False
    ) -> tuple[Any, float, bool]:
        """The global norm, its value and whether the step may apply (one host sync). A
        non-finite norm is measured again in fp64: a finite gradient beyond ~1.8e19 overflows
        fp32 squares and must neither skip the step nor zero the clip."""
        norm, bad = self.norm_and_flag(params, skip_nonfinite, exact)
        value, skip = torch.stack([norm, bad]).tolist()
        if skip and skip_nonfinite and not exact:
            return self.measure(params, skip_nonfinite, exact=True)
        return norm.float(), value, not (skip and skip_nonfinite)

    def norm_and_flag(
        self, params: list[torch.Tensor], skip_nonfinite: bool, exact: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The global norm and a not-finite flag of its dtype; no sync."""
        norm = self.precision.grad_norm(params, self.global_norm, exact=exact)
        bad = (~norm.isfinite()).to(norm.dtype)
        if skip_nonfinite and self.local_norm:
            # A local norm (as torch's clip keeps); the skip must still be the world's.
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return norm, bad


@dataclass(eq=False)
class Unit:
    """Parameters that apply together, the tensors stepped for them, their inner optimizers."""

    params: list[torch.Tensor]
    stepped: list[torch.Tensor]
    optimizers: list[Optimizer] = field(default_factory=list)


class OptimizersContainer(Optimizer, Stateful):
    """A `torch.optim.Optimizer` and DCP `Stateful` over the optimizers of many model parts:
    one inner optimizer per class per unit (a model part, unless the timing splits finer),
    their live `param_groups`, step hooks once per applied `step()`, and torch's flat FQN-keyed
    `state_dict()` with DTensors kept, so DCP reshards it.

    Args:
        param_groups: rules that form param groups by FQN; a parameter no rule matches keeps
            `optimizer_cls` and `optimizer_kwargs`.
        first_match: `param_groups` are ordered and a parameter joins the first rule that
            matches (torchtitan's convention, a catch-all `.*` last); by default a parameter
            matching several rules is refused, so their order never matters.
        precision, gate, timing, outer: the parts (`containers.parts`).
        max_norm: clip the global gradient norm to this; 0 only measures it; None: no clip.
        mesh: the job's named DeviceMesh (pp, dp_replicate, dp_shard, tp) for the global
            norm; None: one stage over the world.
    """

    def __init__(
        self,
        model_parts: Sequence[nn.Module],
        optimizer_cls: type[Optimizer],
        optimizer_kwargs: Mapping[str, Any],
        *,
        param_groups: Sequence[ParamGroupRule] = (),
        first_match: bool = False,
        precision: Precision | None = None,
        gate: Gate | None = None,
        timing: Timing | None = None,
        outer: Outer | Sequence[Outer] | None = None,
        max_norm: float | None = None,
        skip_nonfinite: bool = True,
        mesh: DeviceMesh | None = None,
        ema: ShadowWeights | None = None,
    ) -> None:
        self.model_parts = list(model_parts)
        if not self.model_parts or not all(isinstance(m, nn.Module) for m in self.model_parts):
            raise ValueError(
                f"model_parts = {model_parts!r}: expected a non-empty list of nn.Module"
            )
        if max_norm is not None and not max_norm >= 0:
            raise ValueError(f"max_norm = {max_norm}: use 0 (no clipping) or a positive norm")
        self.precision = precision if precision is not None else Precision()
        self.gate = gate if gate is not None else Gate()
        self.timing = timing if timing is not None else Timing()
        self.outer: list[Outer] = (
            [] if outer is None else list(outer) if isinstance(outer, list | tuple) else [outer]
        )
        self.max_norm = max_norm
        self.skip_nonfinite = skip_nonfinite or "loss_scaling" in self.precision.features
        self.flat_shards = FlatShards(self.model_parts)
        refuse(self._features(ema))
        self._fqns: dict[torch.Tensor, str] = {}
        named_units = self.timing.units(self.model_parts, trainable(self.model_parts))
        self.flat_shards.name({p: fqn for named in named_units for fqn, p in named})
        self.global_norm = GlobalNorm(
            [p for named in named_units for _, p in named],
            mesh,
            shards=self.flat_shards.shard_counts(),
        )
        world = dist.get_world_size() if dist.is_initialized() else 1
        local_norm = world > 1 and not self.global_norm.collective
        stepped_units = [
            [(fqn, self.precision.stepped(fqn, p)) for fqn, p in named] for named in named_units
        ]
        if self.flat_shards:  # before `assign`, whose 2-D check would blame the rules
            refuse_optimizers([optimizer_cls, *(r.optimizer_cls for r in param_groups)])
            refuse_coded([optimizer_kwargs, *(r.overrides for r in param_groups),
                          *(r.optimizer_kwargs for r in param_groups)])  # fmt: skip
        assigned = assign(stepped_units, param_groups, optimizer_cls, optimizer_kwargs, first_match)
        self.units: list[Unit] = []
        self.optimizers: list[Optimizer] = []
        for named, stepped, groups in zip(named_units, stepped_units, assigned):
            unit = Unit(params=[p for _, p in named], stepped=[s for _, s in stepped])
            for fqn, s in stepped:
                self._fqns[s] = fqn
            for cls, (constructor, specs) in groups.items():
                try:
                    opt = cls([{"params": ps, **kw} for ps, kw in specs], **constructor)
                except (TypeError, ValueError, RuntimeError) as e:
                    where = self._refused_alone(cls, constructor, specs)
                    where = where or f"{named[0][0]!r} and its unit"
                    raise ValueError(f"building {cls.__name__} for {where} failed: {e}") from e
                unit.optimizers.append(opt)
                self.optimizers.append(opt)
            self.units.append(unit)
        self._params = [p for unit in self.units for p in unit.params]  # read on every step
        self._model_grads = [
            p for u in self.units for p, s in zip(u.params, u.stepped) if p is not s
        ]
        if not self.optimizers:
            raise ValueError("model_parts have no trainable parameters; nothing to optimize")
        device = self._params[0].device
        self.decision = Decision(self.precision, self.global_norm, device, local_norm)
        self.precision.built(self.optimizers)
        self.defaults = defaults_of(optimizer_cls, optimizer_kwargs)
        # A kernel-skipped step's flag and norm, read when the report is asked.
        self._found_inf: torch.Tensor | None = None
        self._norm: torch.Tensor | None = None
        self.last_report = StepReport()
        self._paths_said = False
        self._settings_checked = False  # this step's hyperparameters checked (inside backward)
        self._optimizer_step_pre_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_post_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: dict[int, Callable] = OrderedDict()
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"
        self.timing.attach(self)
        for part in self.outer:
            part.attach(self)
        self.ema = ema
        if ema is not None:
            ema.attach([p for g in self.param_groups for p in g["params"]], self.precision.weight)
        parts = [p for p in (self.precision.state, *self.outer, ema) if p is not None]
        self._state = ContainerState(
            self, self.optimizers, self._fqns, parts, ema is not None, self.flat_shards
        )

    def _features(self, ema: ShadowWeights | None) -> dict[str, str]:
        named = {**self.precision.features, **self.gate.features, **self.timing.features}
        for part in self.outer:
            named.update(part.features)
        if self.max_norm:
            named["clip"] = f"max_norm = {self.max_norm}"
        if ema is not None:
            named["ema"] = "an EMA of the weights"
        if self.flat_shards:
            named["fsdp1"] = "FSDP1 (FullyShardedDataParallel) model parts"
        return named

    def _refused_alone(
        self, cls: type[Optimizer], constructor: dict[str, Any], specs: list[tuple[list, dict]]
    ) -> str:
        """The FQN of the first parameter `cls` refuses alone (for the error), or ""."""
        for params, kwargs in specs:
            for p in params:
                try:
                    cls([{"params": [p], **kwargs}], **constructor)
                except (TypeError, ValueError, RuntimeError):
                    return repr(self._fqns.get(p, ""))
        return ""

    @property
    def last_step_committed(self) -> bool:
        return self.last_report.committed

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: scaled, and NaN if non-finite (the step skips)."""
        if self.skip_nonfinite:
            finite = loss.detach().isfinite()
            loss = loss * torch.where(finite, 1.0, math.nan).to(loss.dtype)
        scale = self.precision.loss_scale
        return loss * scale if scale is not None and scale != 1.0 else loss

    def backward(self, loss: torch.Tensor) -> None:
        self.scale_loss(loss).backward()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The inner optimizers' own group dicts: writes to them reach the real step."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    def fqn_of(self, tensor: torch.Tensor) -> str:
        """The FQN a tensor of `param_groups` (parameter or master) is saved under."""
        return self._fqns[tensor]

    @property
    def state(self) -> Mapping[torch.Tensor, dict[str, Any]]:  # type: ignore[override]
        return StateView(self.optimizers)

    def __iter__(self) -> Iterator[Optimizer]:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    def __repr__(self) -> str:
        """Each kind of param group (optimizer, state dtype, how many), then every part."""
        groups = Counter(
            f"{type(opt).__name__} ({g.get('moment_dtype', 'float32')} state)"
            for opt in self.optimizers
            for g in opt.param_groups
        )
        inner = ", ".join(f"{what} x{n}" if n > 1 else what for what, n in groups.items())
        parts = [f"precision {self.precision!r}", f"gate {self.gate!r}", f"{self.timing!r}"]
        parts += [f"outer {part!r}" for part in self.outer]
        parts += [f"ema {self.ema!r}"] if self.ema is not None else []
        return f"{type(self).__name__}([{inner}]; {'; '.join(parts)})"

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
        if closure is not None and self.timing.in_backward:
            raise ValueError(
                f"{type(self).__name__}.step(closure): parameters step inside backward, so a "
                "closure that runs backward cannot be re-evaluated by step(); call backward, "
                "then step()"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._settings_checked:
            self._refuse_settings(self.optimizers)
            self._settings_checked = True  # (units applied by `finish` below need no check)
        self._found_inf = self._norm = None
        if not self._paths_said:
            self._paths_said = True
            for line in path_lines(self.optimizers, self.precision.plan):
                logger.info("%s", line)
        with record_function(f"Optimizer.step#{type(self).__name__}.step"):
            self.precision.before_step(self.optimizers)
            if self.timing.in_backward:
                self._with_hooks(lambda: self.timing.finish(self))
                self.last_report = report = self.timing.report(self)
                if report.committed:
                    for part in self.outer:
                        part.after_apply()
                if self.ema is not None and (report.committed or report.partial):
                    self.ema.count()  # (each unit updated it as it applied)
            else:
                self.last_report = self._step_after_backward()
        self._settings_checked = False  # the next step's units check again
        return loss

    def _step_after_backward(self) -> StepReport:
        params = [p for p in self._params if p.grad is not None]
        self.gate.reduce_gradients(params)
        # Commit before measuring: a healing group loads its peer's loss scale inside the
        # commit, and the averaged gradients carry that scale. An uncommitted step tells
        # the precision nothing.
        if not self.gate.commit():
            return StepReport(committed=False, skipped=self.gate.refusal)
        norm, value, finite = None, None, True
        kernels = self.skip_nonfinite and self.leaves_skip_to_kernels(self.optimizers)
        if self.max_norm is not None and kernels:
            # fp64 squares cannot overflow: the norm is finite iff every gradient is.
            norm, found = self.decision.norm_and_flag(params, self.skip_nonfinite, exact=True)
            return self._left_to_kernels(found.float(), norm.float())
        if self.max_norm is not None:
            norm, value, finite = self.decision.measure(params, self.skip_nonfinite)
        elif self.skip_nonfinite:
            # No clip: the cheapest check, one read, agreed by the world.
            world = dist.is_initialized() and dist.get_world_size() > 1
            grads, groups = [p.grad for p in params], [None] if world else []
            if kernels:
                return self._left_to_kernels(nonfinite_flag(grads, groups))
            finite = all_finite(grads, groups)
        refusal = self.decision.refusal(self.optimizers) if finite else None
        self.precision.decided(applied=finite and refusal is None, overflow=not finite)
        if refusal is not None:
            return step_report(
                self.precision, committed=False, skipped=refusal, nonfinite=True, grad_norm=value
            )
        if not finite:
            return self.decision.nonfinite(value)
        self._with_hooks(lambda: self.precision.apply(self.optimizers, norm, self.max_norm))
        for part in self.outer:
            part.after_apply()
        if self.ema is not None:
            self.ema.update()
            self.ema.count()
        return step_report(self.precision, grad_norm=value)

    def apply_unit(self, unit: Unit) -> bool | torch.Tensor:
        """The step's pipeline for one unit whose gradients are all in (inside backward):
        decide (finite, not refused), apply, fold into the EMA. Returns whether it applied,
        or the device flag the kernels took the skip from (no host sync inside backward)."""
        if not self._settings_checked:  # the step's first unit: before any unit applies
            self._refuse_settings(self.optimizers)
            self._settings_checked = True
        grads = [p.grad for p in unit.params if p.grad is not None]
        if self.skip_nonfinite and self.leaves_skip_to_kernels(unit.optimizers, per_unit=True):
            found = nonfinite_flag(grads)
            with inner_steps():
                self.precision.apply(unit.optimizers, found_inf=found)
            return found
        if (self.skip_nonfinite and not all_finite(grads)) or (
            # (the refusal reads the weights: only for a unit whose gradients could apply)
            self.decision.may_refuse and self.precision.refusal(unit.optimizers)
        ):
            return False
        with inner_steps():
            self.precision.apply(unit.optimizers)
        if self.ema is not None:
            self.ema.update(unit.stepped)
        return True

    @staticmethod
    def _refuse_settings(optimizers: Sequence[Optimizer]) -> None:
        """Refuse a step whose hyperparameters hold a float torch's constructors would refuse
        (below 0, or not finite: it would write NaN weights a report calls applied); host
        floats only, so no tensor is read. Loads check every value (`state.flat`)."""
        for opt in optimizers:
            for index, group in enumerate(opt.param_groups):
                for key in NON_NEGATIVE:
                    value = group.get(key)
                    if type(value) is float and not 0.0 <= value < math.inf:
                        raise ValueError(
                            f"{type(opt).__name__} param group {index}: {key} = {value}, which "
                            "torch's optimizers refuse (a number >= 0 and finite); nothing "
                            f"stepped: set param_groups[...][{key!r}] to such a number"
                        )

    def _left_to_kernels(self, found: torch.Tensor, norm: torch.Tensor | None = None) -> StepReport:
        """Apply with the skip left to the kernels (`found`), clipped by `norm`; no host sync."""
        self._with_hooks(
            lambda: self.precision.apply(self.optimizers, norm, self.max_norm, found_inf=found)
        )
        self._found_inf, self._norm = found, norm
        return step_report(self.precision)

    def leaves_skip_to_kernels(
        self, optimizers: Sequence[Optimizer], per_unit: bool = False
    ) -> bool:
        """Whether the kernels may take the skip: nothing follows (hooks, EMA, outer part)."""
        hooks = not per_unit and (self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks)
        return (
            not hooks
            and self.ema is None
            and not self.outer
            and self.decision.kernels_may_skip(optimizers)
        )

    @property
    def last_report(self) -> StepReport:
        """What the last `step()` did (a kernel-skipped step syncs here, when asked)."""
        found, self._found_inf = self._found_inf, None
        norm, self._norm = self._norm, None
        self._last_report = self.decision.read(self._last_report, found, norm)
        return self._last_report

    @last_report.setter
    def last_report(self, report: StepReport) -> None:
        self._last_report = report

    def _with_hooks(self, apply: Callable[[], None]) -> None:
        with_step_hooks(
            self, self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks, apply
        )

    def metrics(self) -> dict[str, float]:
        """The outer parts' numbers for the step's metrics row."""
        return {k: v for part in self.outer for k, v in part.metrics().items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._settings_checked = False
        with record_function(self._zero_grad_profile_name):
            self.gate.on_zero_grad()
            for part in self.outer:
                part.on_zero_grad()
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=set_to_none)
            for p in self._model_grads:  # the model's, beside the masters the optimizers own
                if p.grad is not None and set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
            self.timing.on_zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return self._state.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a flat state dict; on any problem raise and leave the optimizer as it was."""
        self._state.load_state_dict(state_dict)

    def check_checkpoint_keys(
        self, keys: Collection[str] | Mapping[str, torch.dtype | None]
    ) -> str:
        """Refuse a checkpoint of another state layout, else fit `state_dict()` to its keys."""
        return self._state.check_checkpoint_keys(keys)

    def forget_checkpoint_keys(self) -> None:
        """Undo `check_checkpoint_keys` (the load failed)."""
        self._state.forget_checkpoint_keys()

    @contextlib.contextmanager
    def ema_weights(self) -> Iterator[None]:
        """The model parts hold the EMA of their weights inside the block."""
        if self.ema is None:
            raise ValueError(
                f"{type(self).__name__}.ema_weights(): this container keeps no EMA; build it "
                "with ema=ShadowWeights(decay) ([ema] enable = true)"
            )
        model_param = {id(s): p for u in self.units for p, s in zip(u.params, u.stepped)}
        with self.ema.swapped_into([model_param[id(s)] for s in self.ema.params]):
            yield


Hooks = Mapping[int, Callable[..., Any]]


def with_step_hooks(
    optimizer: Optimizer, pre: Hooks, post: Hooks, apply: Callable[[], None]
) -> None:
    """Run `apply` as `optimizer`'s step between its step hooks, in torch's order."""
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}
    for hook in [*torch_optimizer._global_optimizer_pre_hooks.values(), *pre.values()]:
        result = hook(optimizer, args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(
                    f"step pre hook {hook!r} must return None or (args, kwargs), not {result!r}"
                )
            args, kwargs = result
    with inner_steps():
        apply()
    for hook in [*post.values(), *torch_optimizer._global_optimizer_post_hooks.values()]:
        hook(optimizer, args, kwargs)


@contextlib.contextmanager
def inner_steps() -> Iterator[None]:
    """Inner steps without torch's global step hooks (their tables emptied meanwhile)."""
    tables = (
        torch_optimizer._global_optimizer_pre_hooks,
        torch_optimizer._global_optimizer_post_hooks,
    )
    saved = [dict(t) for t in tables]
    for t in tables:
        t.clear()
    try:
        yield
    finally:
        for t, hooks in zip(tables, saved):
            t.update(hooks)
