"""`MasterWeights`: bf16/fp16 model parameters, fp32 masters sharded the same way, stepped
in flat buffers (`flat_adam`) or per tensor (`eager`), unscaled and clipped in one multiply.
The norm is non-finite if any gradient is, so 0 * inf cannot hide an overflow."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from containers.norm import GlobalNorm
from containers.parts import Precision
from containers.precision.eager import step_masters
from containers.precision.flat_adam import FlatGroup
from containers.precision.loss_scaler import LossScaler
from containers.precision.master_state import MasterState
from containers.precision.overflow import overflow_refusal
from containers.precision.settings import MixedPrecisionSettings
from containers.precision.sums import FullPrecisionSums, from_initial
from containers.state.param_groups import dcp_fqn
from containers.tensors import local
from containers.update.plan import Plan, engine_takes, plan_of

__all__ = ["MasterWeights"]

logger = logging.getLogger(__name__)


class MasterWeights(Precision):
    """bf16/fp16 model parameters; the inner optimizers step fp32 masters of them."""

    def __init__(self, settings: MixedPrecisionSettings | None = None) -> None:
        self.settings = settings if settings is not None else MixedPrecisionSettings()
        self.param_dtype = getattr(torch, self.settings.param_dtype)
        self.master_dtype = getattr(torch, self.settings.master_dtype)
        if self.param_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"param_dtype = {self.param_dtype}: use torch.bfloat16 or torch.float16"
            )
        self.scaler = LossScaler(self.settings, fp16=self.param_dtype == torch.float16)
        self.remainders = self.settings.store_param_remainders
        if self.remainders and self.param_dtype != torch.bfloat16:
            raise ValueError(
                f"[mixed_precision] store_param_remainders = true with param_dtype "
                f"{self.settings.param_dtype!r}: remainders complete bfloat16 parameters; use "
                "param_dtype 'bfloat16', or store_param_remainders = false"
            )
        self.offloaded = False
        self.sums = (
            FullPrecisionSums(self.master_dtype)
            if self.settings.grad_accumulation_dtype == "float32"
            else None
        )
        self.model_param: dict[int, torch.Tensor] = {}  # id(master) -> model parameter
        self._flat: dict[int, list[FlatGroup]] = {}  # id(inner optimizer) -> its flat groups
        self.flat_of: dict[int, tuple[FlatGroup, int]] = {}  # id(master) -> (its group, index)
        self._initial: dict[str, torch.Tensor] = {}  # fqn -> full-precision value before the cast
        self.unscale = 1.0  # 1 / the loss scale this step's gradients carry
        self.backing_off = False
        self.state = MasterState(self)

    @property
    def features(self) -> dict[str, str]:  # type: ignore[override]
        return self.settings.features()

    @property
    def loss_scale(self) -> float:  # type: ignore[override]
        return self.scaler.scale

    def __repr__(self) -> str:
        s = self.settings
        masters = f"{s.master_dtype} masters" + (" as int16 remainders" if self.remainders else "")
        sums = ", float32 gradient sums" if self.sums is not None else ""
        scaling = f"loss scaling {self.scaler.mode}"
        return f"MasterWeights({s.param_dtype} params, {masters}, {scaling}{sums})"

    def cast_model(self, model: nn.Module) -> nn.Module:
        """Cast the floating-point parameters (not buffers), keeping their full-precision
        values for `stepped`: a master made from the rounded parameter loses the rounding
        residue, and equal early Adam updates would round alike, biasing a tensor by up to
        half an ulp. Before or after FSDP2 shards the model: the cast goes through
        `nn.Module._apply`, which FSDP2 follows (its sharded parameters reset)."""
        cast = {id(p) for p in model.parameters() if p.is_floating_point()}
        with torch.no_grad():
            for name, p in model.named_parameters():
                if id(p) in cast and p.dtype == self.master_dtype:  # (keyed as `stepped` asks)
                    self._initial[dcp_fqn(name)] = p.detach()
        model._apply(lambda t: t.to(self.param_dtype) if id(t) in cast else t)
        return model

    def stepped(self, fqn: str, param: torch.Tensor) -> torch.Tensor:
        if param.dtype != self.param_dtype:
            raise ValueError(
                f"parameter {fqn!r} is {param.dtype}, not param_dtype {self.param_dtype}; "
                "cast the model (or its FSDP2 sharded parameters) first, or use "
                "container 'default' for full-precision models"
            )
        master = param.detach().to(self.master_dtype)
        initial = self._initial.pop(fqn, None)
        if initial is not None and initial.shape == param.shape:
            from_initial(master, param, initial)
        self.model_param[id(master)] = param
        if self.sums is not None:
            self.sums.watch(param, master)
        return master

    def built(self, optimizers: Sequence[Optimizer]) -> None:
        if self.remainders:
            self._check_remainders(optimizers)
        for opt in optimizers:
            flats = []
            for group in opt.param_groups:
                plan = plan_of(type(opt), group, self.masters)
                if plan.engine:
                    flats.append(FlatGroup(opt, group, self._model_of(group), plan))
            if flats:
                self._flat[id(opt)] = flats
                opt.register_load_state_dict_post_hook(_mark_stale(flats))
                for flat in flats:
                    self.flat_of.update({id(m): (flat, i) for i, m in enumerate(flat.masters)})

    @property
    def masters(self) -> str:
        """The master codec of the groups the engine steps (`containers.update.codecs`)."""
        return "remainders" if self.remainders else "fp32"

    def plan(self, opt: Optimizer, index: int) -> Plan:
        """The plan the group was built with (remainder masters at rest are stride 0)."""
        for flat in self._flat.get(id(opt), ()):
            if flat.index == index:
                return flat.plan
        return plan_of(type(opt), opt.param_groups[index], "fp32")

    def weight(self, stepped: torch.Tensor) -> torch.Tensor:
        """The fp32 master (decoded where kept as remainders: a new tensor)."""
        found = self.flat_of.get(id(stepped))
        return found[0].master_value(found[1]) if found is not None else stepped

    @torch.no_grad()
    def set_weight(self, stepped: torch.Tensor, value: torch.Tensor) -> None:
        """Set a master's local piece to `value`, and its model parameter to its rounding."""
        found = self.flat_of.get(id(stepped))
        if found is not None:
            found[0].load_master(found[1], value)
            return
        super().set_weight(stepped, value)
        local(self.model_param[id(stepped)]).copy_(value)

    def _check_remainders(self, optimizers: Sequence[Optimizer]) -> None:
        """Refuse remainders for an Adam/AdamW group that cannot step flat, or if none can."""
        others, flat = set(), False
        for opt in optimizers:
            for group in opt.param_groups:
                if not group["params"]:
                    continue
                if engine_takes(type(opt), group):
                    flat = True
                elif isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
                    raise ValueError(
                        f"[mixed_precision] store_param_remainders = true with a "
                        f"{type(opt).__name__} group that is not fused (or uses amsgrad): "
                        "remainders complete the masters in torch's fused step; use "
                        "implementation 'fused' or store_param_remainders = false"
                    )
                else:
                    others.add(type(opt).__name__)
        if not flat:
            raise ValueError(
                f"[mixed_precision] store_param_remainders = true with only "
                f"{', '.join(sorted(others))}: remainders complete the masters of fused "
                "Adam/AdamW groups; use AdamW or store_param_remainders = false"
            )
        if others:
            logger.info(
                "[mixed_precision] store_param_remainders: the %s groups keep fp32 masters "
                "(remainders complete those of fused Adam/AdamW groups)",
                ", ".join(sorted(others)),
            )

    def _model_of(self, group: dict) -> list[torch.Tensor]:
        return [self.model_param[id(m)] for m in group["params"]]

    def steps_flat(self, opt: Optimizer) -> bool:
        """Every param group of `opt` keeps its state in flat buffers."""
        return len(self._flat.get(id(opt), ())) == len(opt.param_groups)

    def _pairs(self, optimizers: Sequence[Optimizer]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pairs = []
        for opt in optimizers:
            for group in opt.param_groups:
                for m in group["params"]:
                    p = self.model_param[id(m)]
                    if p.grad is not None:
                        pairs.append((p, m))
        return pairs

    def before_step(self, optimizers: Sequence[Optimizer]) -> None:
        self._initial.clear()  # what no master took (e.g. other pipeline stages' parameters)
        if self.offloaded:
            self.reload(optimizers)
        if self.sums is not None:
            self.sums.restore()  # the finite check, norm and clip read the rounded sums
        self.unscale = 1.0 / self.scaler.scale  # the scale this step's loss was scaled by

    @torch.no_grad()
    def grad_norm(
        self, params: Sequence[torch.Tensor], over: GlobalNorm | None = None, exact: bool = False
    ) -> torch.Tensor:
        over = over if over is not None else GlobalNorm(params)
        return over([p.grad for p in params], params=params, exact=exact) * self.unscale

    def refusal(self, optimizers: Sequence[Optimizer]) -> str | None:
        if self.param_dtype != torch.float16:
            return None
        groups = []
        for opt in optimizers:
            for group in opt.param_groups:
                weights = self._model_of(group)
                groups.append((opt, group, [local(w) for w in weights if w.grad is not None]))
        return overflow_refusal(groups, torch.finfo(self.param_dtype).max)

    def decided(self, applied: bool, overflow: bool | None = None) -> None:
        overflow = not applied if overflow is None else overflow
        self.backing_off = overflow and self.scaler.can_back_off
        if applied or overflow:  # a refused step tells the scale nothing
            self.scaler.update(overflow=overflow)
        if not applied:
            for p in self.model_param.values():
                p.grad = None
            if self.sums is not None:
                self.sums.clear()

    @torch.no_grad()
    def apply(
        self,
        optimizers: Sequence[Optimizer],
        grad_norm: torch.Tensor | None = None,
        max_norm: float | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> None:
        clip = 1.0
        if max_norm and grad_norm is not None:
            clip = min(1.0, max_norm / (grad_norm.item() + 1e-6))
        factor = clip * self.unscale  # unscale and clip in the same multiply
        if found_inf is not None and not all(
            self.steps_flat(opt) and all(f.ready() for f in self._flat[id(opt)])
            for opt in optimizers
        ):
            # torch's own step takes no flag: decide here
            if found_inf.item():
                self.decided(applied=False)
                return
            found_inf = None
        eager = []
        with contextlib.ExitStack() as unready:
            for opt in optimizers:
                _stepped(opt)
                stepped = 0
                for flat in self._flat.get(id(opt), ()):
                    if flat.ready():
                        flat.step(factor, found_inf)  # drops gradients
                        stepped += 1
                    else:
                        unready.enter_context(flat.materialized())
                # the rest steps eagerly (`_pairs` skips what stepped flat)
                eager.append([] if stepped == len(opt.param_groups) else self._pairs([opt]))
            if any(eager):
                step_masters(optimizers, eager, factor, self.master_dtype, self.sums is not None)

    def _move(self, optimizers: Sequence[Optimizer], device: torch.device) -> None:
        pin = device.type == "cpu" and torch.cuda.is_available()
        with torch.no_grad():
            for opt in optimizers:
                flats = self._flat.get(id(opt), [])
                for flat in flats:
                    flat.move(device, lambda t, d: _moved(t, d, pin))
                done = {id(m) for flat in flats for m in flat.masters}
                for group in opt.param_groups:
                    for m in group["params"]:
                        if id(m) not in done:
                            m.data = _moved(m.data, device, pin)
                for m, st in opt.state.items():
                    for key, value in st.items():
                        moves = isinstance(value, torch.Tensor) and value.dim() > 0
                        if moves and id(m) not in done:
                            st[key] = _moved(value, device, pin)
        if device.type == "cuda" or pin:
            # copies to pinned memory are asynchronous too: wait before the host reads them
            torch.cuda.current_stream().synchronize()

    def offload(self, optimizers: Sequence[Optimizer]) -> None:
        """Move masters and optimizer state to CPU (pinned, non-blocking on CUDA)."""
        self._move(optimizers, torch.device("cpu"))
        self.offloaded = True

    def reload(self, optimizers: Sequence[Optimizer]) -> None:
        device = local(next(iter(self.model_param.values()))).device
        self._move(optimizers, device)
        self.offloaded = False


def _mark_stale(flats: list[FlatGroup]):
    """Flat groups adopt a load at next use, so a later failure can roll back."""

    def hook(opt: Optimizer) -> None:
        for flat in flats:
            flat.stale = True

    return hook


def _stepped(opt: Optimizer) -> None:
    """Mark `opt` as stepped for LR schedulers (the flat paths bypass `opt.step`)."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        opt._opt_called = True  # type: ignore[attr-defined]


def _moved(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    if t.device == device:
        return t
    if pin:
        out = torch.empty_like(local(t), device="cpu", pin_memory=True)
        out.copy_(local(t), non_blocking=True)
        if isinstance(t, DTensor):
            return DTensor.from_local(
                out, t.device_mesh, t.placements, shape=t.shape, stride=t.stride()
            )
        return out
    return t.to(device, non_blocking=True)
