"""What each built-in optimizer takes from the `[optimizer]` section (torch's keyword names), and
which of them torch cannot step on parameters sharded over ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from config import ConfigError
from config import Optimizer as OptimizerConfig

__all__ = [
    "adafactor_kwargs",
    "adagrad_kwargs",
    "adam_kwargs",
    "is_sharded",
    "momentum_kwargs",
    "muon_kwargs",
    "refuse_on_shards",
]


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
