"""The containers as torchtitan's optimizer: one line of a torchtitan (0.3.0) config.

    from containers import torchtitan as oc

    config.optimizer = oc.OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 3e-4})],
        container="mixed_precision", store_param_remainders=True,
    )
    config.metrics = oc.MetricsProcessor.Config()  # the step report in torchtitan's metrics

torchtitan's Trainer builds its optimizer with `config.optimizer.build(model_parts=...)` once
the model is parallelized, materialized and initialized. `OptimizersContainer.Config`
subclasses torchtitan's, so its fields mean what they mean there: `param_groups` are ordered
and the first match wins (each group's `optimizer_kwargs` complete, a catch-all last), and
`implementation` picks fused / foreach / for-loop kernels ("fused_opt_states_bf16": bf16
moments). Ours are added: the container, the moments' storage, remainders, an EMA, the skip of
non-finite steps. Building it returns one of the library's containers; what a torchtitan job
cannot have is refused in one line there. torchtitan is imported here only.
"""

from __future__ import annotations

import inspect
import re
import sys
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn
from torch.optim import Optimizer
from torchtitan.components.metrics import MetricsProcessor as TitanMetricsProcessor
from torchtitan.components.optimizer import OptimizersContainer as TitanOptimizersContainer
from torchtitan.config import Configurable

import containers
from containers.ema import ShadowWeights
from containers.state.param_groups import ParamGroupRule, dcp_fqn

__all__ = ["MetricsProcessor", "OptimizersContainer"]

_MOMENTS = ("float32", "bfloat16", "8bit", "4bit")


class OptimizersContainer(Configurable):
    """torchtitan's optimizer component, built as one of the library's containers.

    `Config.build(model_parts=...)` (what torchtitan's Trainer calls) returns a
    `containers.OptimizersContainer`, `OptimizersInBackwardContainer` or
    `MixedPrecisionOptimizersContainer`: a `torch.optim.Optimizer` and DCP `Stateful` whose
    `state_dict()` keys are torchtitan's own container's.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(TitanOptimizersContainer.Config):
        container: Literal["default", "in_backward", "mixed_precision"] = "default"
        """default: torch's step after backward; in_backward: each unit steps in backward as
        its gradients land (needs torchtitan's `training.max_norm = 0`); mixed_precision:
        the model's parameters cast to `param_dtype`, exact fp32 masters kept here."""

        moment_dtype: Literal["float32", "bfloat16", "8bit", "4bit"] | None = None
        """How Adam/AdamW keep their moments; None: as `implementation` says (bfloat16 for
        "fused_opt_states_bf16", else float32)."""

        param_dtype: Literal["bfloat16", "float16"] = "bfloat16"
        """mixed_precision: the model's parameter dtype (float16 is refused: it needs loss
        scaling, and torchtitan calls `loss.backward()` itself)."""

        store_param_remainders: bool = False
        """mixed_precision: keep the fp32 masters as int16 remainders beside the bf16
        parameters (2 bytes a parameter instead of 4, bit for bit the same masters)."""

        ema_decay: float = 0.0
        """Keep an exponential moving average of the weights, saved with the optimizer
        state; 0: none."""

        skip_nonfinite: bool = True
        """A step whose gradients are not finite changes nothing (torchtitan then stops on
        the non-finite loss, or, where only gradients were, trains on)."""

        def __post_init__(self) -> None:
            if self.moment_dtype not in (None, *_MOMENTS):
                raise ValueError(
                    f"optimizer.moment_dtype = {self.moment_dtype!r}: use one of {_MOMENTS}"
                )
            bf16 = self.implementation == "fused_opt_states_bf16"
            if bf16 and self.moment_dtype not in (None, "bfloat16"):
                raise ValueError(
                    f"optimizer.implementation = 'fused_opt_states_bf16' keeps bf16 moments, "
                    f"optimizer.moment_dtype = {self.moment_dtype!r} asks otherwise: set "
                    "implementation = 'fused' beside that moment_dtype"
                )
            if self.param_dtype != "bfloat16" and self.container == "mixed_precision":
                raise ValueError(
                    f"optimizer.param_dtype = {self.param_dtype!r}: float16 weights need loss "
                    "scaling, and torchtitan's Trainer calls loss.backward() itself; use "
                    "'bfloat16' (no scaling needed)"
                )
            if not 0.0 <= self.ema_decay < 1.0:
                raise ValueError(
                    f"optimizer.ema_decay = {self.ema_decay!r}: use 0 (no EMA) or a decay in "
                    "(0, 1), e.g. 0.999"
                )

    def __new__(  # type: ignore[misc]
        cls, config: Config, *, model_parts: list[nn.Module]
    ) -> containers.OptimizersContainer:
        return build(config, model_parts)


def build(config: OptimizersContainer.Config, model_parts: list[nn.Module]) -> Any:
    """The library's container for `config` over `model_parts` (see `OptimizersContainer`)."""
    if config.optimizer_factory_kwargs_by_name:
        raise ValueError(
            "optimizer.optimizer_factory_kwargs_by_name = "
            f"{config.optimizer_factory_kwargs_by_name!r}: torchtitan's factories only (e.g. "
            "DistMuon's); give each group's settings in its optimizer_kwargs"
        )
    if not config.param_groups:
        raise ValueError(
            "optimizer.param_groups is empty: add at least a catch-all, e.g. "
            "ParamGroupConfig(pattern='.*', optimizer_name='AdamW', optimizer_kwargs={'lr': ...})"
        )
    moments = config.moment_dtype or (
        "bfloat16" if config.implementation == "fused_opt_states_bf16" else "float32"
    )
    implementation = {
        "fused": config.implementation in ("fused", "fused_opt_states_bf16"),
        "foreach": config.implementation == "foreach",
    }  # (torchtitan's, for every group)
    rules = []
    for group in config.param_groups:
        name = group.optimizer_name
        kwargs = {**implementation, **_moments(name, moments), **group.optimizer_kwargs}
        cls = _optimizer_class(name, moments)
        rules.append(ParamGroupRule(group.pattern, optimizer_cls=cls, optimizer_kwargs=kwargs))
    _refuse_unmatched(model_parts, [g.pattern for g in config.param_groups])
    trainer = _building_trainer()
    parts: dict[str, Any] = {
        "param_groups": rules,
        "first_match": True,
        "max_norm": None,  # torchtitan clips (`training.max_norm`) before `step()`
        "skip_nonfinite": config.skip_nonfinite,
        "ema": ShadowWeights(config.ema_decay) if config.ema_decay else None,
    }
    first = rules[0]
    args = (model_parts, first.optimizer_cls, first.optimizer_kwargs)
    if config.container == "in_backward":
        if trainer is None:
            raise ValueError(
                "optimizer.container = 'in_backward' is built outside torchtitan's Trainer, "
                "whose training.max_norm and gradient accumulation it must know: build "
                "containers.OptimizersInBackwardContainer(..., gradient_accumulation_steps=N) "
                "directly there"
            )
        max_norm = trainer.config.training.max_norm
        if max_norm > 0:
            raise ValueError(
                f"optimizer.container = 'in_backward' steps inside backward, so torchtitan's "
                f"training.max_norm = {max_norm} would clip gradients already applied and "
                "freed (silently no clip): set training.max_norm = 0, or use container "
                "'default' to clip"
            )
        return containers.OptimizersInBackwardContainer(
            *args, gradient_accumulation_steps=trainer.gradient_accumulation_steps, **parts
        )
    if config.container == "mixed_precision":
        precision = containers.MasterWeights(
            containers.MixedPrecisionSettings(
                param_dtype=config.param_dtype,
                loss_scaling="none",
                store_param_remainders=config.store_param_remainders,
            )
        )
        for part in model_parts:  # (after torchtitan's init_weights: the masters are its fp32)
            precision.cast_model(part)
        return containers.MixedPrecisionOptimizersContainer(*args, precision=precision, **parts)
    return containers.OptimizersContainer(*args, **parts)


def _optimizer_class(name: str, moments: str) -> type[Optimizer]:
    """torchtitan's optimizer name as a class: Adam and AdamW (lean where their moments are
    not fp32), or any `torch.optim` optimizer by its name."""
    if name in ("Adam", "AdamW") and moments != "float32":
        return containers.LeanAdam if name == "Adam" else containers.LeanAdamW
    cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise ValueError(
            f"optimizer.param_groups optimizer_name = {name!r}: not an optimizer here; use "
            "'Adam', 'AdamW' or a torch.optim class name ('DistMuon' is torchtitan's alone)"
        )
    if moments != "float32":
        raise ValueError(
            f"optimizer.moment_dtype = {moments!r} applies to Adam and AdamW only, and a "
            f"param group uses {name!r}: keep float32 moments or use Adam/AdamW there"
        )
    return cls


def _moments(name: str, moments: str) -> dict[str, Any]:
    return {"moment_dtype": moments} if moments != "float32" and "Adam" in name else {}


def _refuse_unmatched(model_parts: list[nn.Module], patterns: list[str]) -> None:
    """torchtitan's rule: every trainable parameter matches a group (no implicit default),
    by its name as checkpoints key it, as the container matches it."""
    compiled = [re.compile(p) for p in patterns]
    for part in model_parts:
        for name, p in part.named_parameters():
            fqn = dcp_fqn(name)
            if p.requires_grad and not any(rx.search(fqn) for rx in compiled):
                raise ValueError(
                    f"parameter {fqn!r} matches no optimizer.param_groups pattern "
                    f"{patterns}; add a catch-all ParamGroupConfig(pattern='.*', ...) last"
                )


def _building_trainer() -> Any | None:
    """The torchtitan Trainer whose `__init__` is building this container, if any: torchtitan
    passes the optimizer only `model_parts`, and its `training` keys (the clip, the gradient
    accumulation) decide what the in-backward container may do."""
    module = sys.modules.get("torchtitan.trainer")
    if module is None:  # (no Trainer at all)
        return None
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, module.Trainer) and hasattr(owner, "gradient_accumulation_steps"):
            return owner
        frame = frame.f_back
    return None


class MetricsProcessor(TitanMetricsProcessor):
    """torchtitan's metrics with the container's step report: `optimizer/skipped_steps`
    (steps that changed no weight since this run started), `optimizer/committed` (the last
    step's) and `optimizer/loss_scale` where one is kept.

    torchtitan's Trainer hands it the optimizer (`metrics_processor.optimizers`) and asks
    `should_log` at every step's start: the report of the step before is read there (one
    flag read a step where the kernels took the skip)."""

    @dataclass(kw_only=True, slots=True)
    class Config(TitanMetricsProcessor.Config):
        pass

    def __init__(self, config: Config, **kwargs: Any) -> None:
        self._skipped = 0
        self._seen: Any = None
        super().__init__(config, **kwargs)

    def _report(self) -> Any:
        """The container's last step report, counted once; None for another optimizer."""
        if not isinstance(self.optimizers, containers.OptimizersContainer):
            return None
        report = self.optimizers.last_report
        if report is not self._seen:  # (a new step's)
            self._seen = report
            self._skipped += not report.committed
        return report

    def should_log(self, step: int) -> bool:
        if step > 1:
            self._report()
        return super().should_log(step)

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        extra = dict(extra_metrics or {})
        report = self._report()
        if report is not None:
            extra["optimizer/skipped_steps"] = self._skipped
            extra["optimizer/committed"] = int(report.committed)
            if report.loss_scale is not None:
                extra["optimizer/loss_scale"] = report.loss_scale
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)
