"""What each built-in optimizer takes from the `[optimizer]` section (torch's keyword names), the
kernel flags its `implementation` means on a device, and which of them torch cannot step on
parameters sharded over ranks."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from config import ConfigError
from config import Optimizer as OptimizerConfig
from containers import LeanAdam, LeanAdamW
from containers.update.codecs import BF16_FUSED_DEVICES

__all__ = [
    "COMPILED",
    "adafactor_kwargs",
    "adagrad_kwargs",
    "adam_kwargs",
    "implementation_kwargs",
    "is_sharded",
    "momentum_kwargs",
    "muon_kwargs",
    "refuse_on_shards",
    "slower_than_compiled",
]


COMPILED = (LeanAdam, LeanAdamW)
"""The classes `implementation = "compiled"` steps (`containers.update.compiled`)."""


def slower_than_compiled(cls: type[Optimizer], kwargs: dict[str, Any], device: torch.device) -> str:
    """A line for the log where `cls(**kwargs)` keeps lean moments on a GPU that its eager
    path steps several times slower than `implementation = "compiled"` (measured on an H100,
    benchmarks/README.md); "" elsewhere."""
    moments = kwargs.get("moment_dtype", "float32")
    if device.type != "cuda" or cls not in COMPILED or kwargs.get("compiled"):
        return ""
    if moments == "8bit":
        eager, graph = "11.9x", "1.9x"
    elif moments == "bfloat16" and device.type not in BF16_FUSED_DEVICES:
        eager, graph = "2.0x", "0.9x"
    else:
        return ""
    return (
        f"[optimizer] moment_dtype = {moments!r} on CUDA steps through torch ops here ({eager} "
        f"an fp32 AdamW step on an H100); implementation = 'compiled' steps them in one graph "
        f"({graph})"
    )


def _given(**kwargs: Any) -> dict[str, Any]:
    """The keys set in the config; unset ones (None) keep the optimizer's own default."""
    return {k: v for k, v in kwargs.items() if v is not None}


def adam_kwargs(cfg: OptimizerConfig) -> dict[str, Any]:
    """The Adam family's settings (Adam, AdamW, Adamax, NAdam, RAdam)."""
    return {
        "lr": cfg.lr,
        "betas": (cfg.beta1, cfg.beta2),
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
    }


def momentum_kwargs(cfg: OptimizerConfig) -> dict[str, Any]:
    """SGD's settings, which Muon shares (its momentum and nesterov defaults differ)."""
    return {
        "lr": cfg.lr,
        "weight_decay": cfg.weight_decay,
        **_given(momentum=cfg.momentum, nesterov=cfg.nesterov),
    }


def muon_kwargs(cfg: OptimizerConfig) -> dict[str, Any]:
    # Muon's eps (a floor of the Newton-Schulz normalization) keeps torch's 1e-7: the
    # config's `eps` is Adam's denominator term, a different quantity.
    return {
        **momentum_kwargs(cfg),
        "ns_steps": cfg.ns_steps,
        "adjust_lr_fn": cfg.adjust_lr_fn,
        "ns_dtype": cfg.ns_dtype,
    }


def adafactor_kwargs(cfg: OptimizerConfig) -> dict[str, Any]:
    """Adafactor's settings; torch takes its two epsilons as one `eps` pair."""
    return {
        "lr": cfg.lr,
        "beta2_decay": cfg.beta2_decay,
        "eps": (cfg.eps1, cfg.eps2),
        "d": cfg.d,
        "weight_decay": cfg.weight_decay,
    }


def adagrad_kwargs(cfg: OptimizerConfig) -> dict[str, Any]:
    """Adagrad's settings (its lr decay and initial accumulator keep torch's 0)."""
    return {"lr": cfg.lr, "eps": cfg.eps, "weight_decay": cfg.weight_decay}


# torch optimizers that fail inside their first step on parameters split over ranks (FSDP2,
# tensor parallel) in torch 2.13, and why: refused when built instead.
_FAILS_ON_SHARDS: dict[type[Optimizer], str] = {
    torch.optim.Adafactor: (
        "its factored second moment squares a row/column norm in place, which DTensor cannot "
        "do when the norm runs over a sharded dim"
    ),
}


def is_sharded(model_parts: Sequence[nn.Module]) -> bool:
    """Whether any parameter is split over ranks (a DTensor sharded on a mesh dim above 1);
    the same answer on every rank, whatever its share."""
    return any(
        isinstance(p, DTensor)
        and any(pl.is_shard() and p.device_mesh.size(d) > 1 for d, pl in enumerate(p.placements))
        for m in model_parts
        for p in m.parameters()
    )


def refuse_on_shards(cls: type[Optimizer], name: str, where: str, sharded: bool) -> None:
    """Raise `ConfigError` if `cls` cannot step `sharded` parameters (see `is_sharded`)."""
    reason = _FAILS_ON_SHARDS.get(cls)
    if sharded and reason is not None:
        raise ConfigError(
            f"{where} name = {name!r}: torch's {cls.__name__} cannot step parameters sharded "
            f"over ranks (FSDP2, tensor parallel): {reason}; train it on one rank or pick "
            "another optimizer (e.g. AdamW, or Muon for the hidden matrices)"
        )


def _fused_devices() -> set[str]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return set(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - older torch
        return {"cuda", "cpu"}


def _fused_takes_dtensor(optimizer_cls: type[Optimizer]) -> bool:
    """Whether DTensor can run `optimizer_cls`'s fused kernel (torch 2.13: Adam and AdamW only;
    fused SGD on FSDP2 or TP parameters fails inside the first step)."""
    op = getattr(torch.ops.aten, f"_fused_{optimizer_cls.__name__.lower()}_", None)
    try:
        prop = DTensor._op_dispatcher.sharding_propagator
        known = {*prop.op_strategy_funcs, *prop.op_to_rules}
        known |= set(getattr(prop, "op_single_dim_strategy_funcs", {}))
        return op is not None and op.default in known
    except AttributeError:  # private API moved: foreach is the safe choice
        return False


def implementation_kwargs(
    optimizer_cls: type[Optimizer],
    implementation: str,
    device: torch.device,
    where: str,
    dtensor: bool = False,
) -> dict[str, bool]:
    """Kernel flags for `implementation` ("auto" picks fused where torch has it on `device`,
    and, for `dtensor` (sharded or tensor-parallel) parameters, where DTensor can run it)."""
    if implementation == "compiled":
        if optimizer_cls not in COMPILED:
            raise ConfigError(
                f"{where} implementation = 'compiled': {optimizer_cls.__name__} has no "
                "compiled step (Adam and AdamW have); use 'auto'"
            )
        return {"fused": True, "compiled": True}
    accepted = inspect.signature(optimizer_cls).parameters
    has_fused = "fused" in accepted and device.type in _fused_devices()
    fused_ok = has_fused and (not dtensor or _fused_takes_dtensor(optimizer_cls))
    name = optimizer_cls.__name__
    if implementation == "auto":
        return {"fused": True} if fused_ok else {}
    if implementation == "fused":
        if not fused_ok:
            why = "has no fused kernel" if "fused" not in accepted else f"has none on {device}"
            if has_fused:
                why = "has no fused kernel for DTensor (FSDP2 / tensor-parallel) parameters"
            use = "'auto' or 'foreach'" if "foreach" in accepted else "'auto'"
            raise ConfigError(f"{where} implementation = 'fused': {name} {why}; use {use}")
        return {"fused": True}
    if "foreach" not in accepted:
        if implementation == "for-loop":
            return {}  # a per-tensor loop is all it has (Muon)
        raise ConfigError(
            f"{where} implementation = {implementation!r}: {name} takes no foreach flag; use 'auto'"
        )
    flags = {"foreach": implementation == "foreach"}
    if "fused" in accepted:
        flags["fused"] = False
    return flags
