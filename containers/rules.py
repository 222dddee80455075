"""The one table of part compositions that cannot work, each with its reason."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

__all__ = ["FEATURES", "RULES", "Rule", "conflict", "refuse"]

FEATURES = frozenset(
    {
        "in_backward",  # units step inside backward (`InBackward`)
        "clip",  # the global gradient norm is clipped (max_norm above 0)
        "torchft",  # torchft decides commits and may average gradients across replica groups
        "diloco",  # DiLoCo's outer step writes the stepped weights every sync_steps
        "fsdp1",  # the model parts are FSDP1 (FullyShardedDataParallel)
        "loss_scaling",  # the loss is scaled (fp16), so an overflow skips the step
        "fp32_sums",  # the masters step on fp32 sums of the gradients, kept after backward
        "ema",  # an exponential moving average of the stepped weights
        "masters",  # the inner optimizers step fp32 masters of the model's parameters
        "overflow_refusal",  # the precision may refuse a finite update (fp16 weights)
        "host_skip",  # the precision must see each skip on the host, never in the kernels
    }
)


@dataclass(frozen=True)
class Rule:
    """Features `a` and `b` cannot work together, because of `reason`."""

    a: str
    b: str
    reason: str


RULES: tuple[Rule, ...] = (
    Rule("fsdp1", "ema", "FSDP1's flat-parameter slices are not kept as averages yet"),
    Rule(
        "fsdp1",
        "diloco",
        "DiLoCo's global weights are kept as DTensors like their parameters, which FSDP1's "
        "flat slices are not",
    ),
    Rule(
        "fsdp1",
        "torchft",
        "torchft serves a healing peer the group's state from its own thread, and the state "
        "dicts of FSDP1 parts gather every flat parameter across the group's ranks "
        "(collectives that thread cannot run alongside training)",
    ),
    Rule(
        "fsdp1",
        "in_backward",
        "FSDP1 computes gradients on its flat parameters and gives the original parameters "
        "theirs only when backward has ended, so no unit can step inside backward",
    ),
    Rule("in_backward", "diloco", "DiLoCo's outer step follows the whole inner step"),
    Rule(
        "in_backward",
        "torchft",
        "torchft decides whether a step commits after backward, once every gradient is "
        "averaged across replica groups",
    ),
    Rule(
        "in_backward",
        "clip",
        "the global gradient norm exists only once backward has ended, after units stepped",
    ),
    Rule(
        "in_backward",
        "fp32_sums",
        "units step inside backward from their bf16 gradients, while the fp32 sums are "
        "stepped after backward",
    ),
    Rule(
        "in_backward",
        "loss_scaling",
        "an overflow found after some units stepped cannot be undone",
    ),
    Rule(
        "fp32_sums",
        "torchft",
        "torchft averages the bf16 gradients across replica groups, but the masters would step "
        "on this group's own fp32 sums",
    ),
)
# (the first that applies is reported: FSDP1's first, as they are about the model)


def conflict(features: Collection[str]) -> Rule | None:
    return next((r for r in RULES if r.a in features and r.b in features), None)


def refuse(named: Mapping[str, str]) -> None:
    """Raise ValueError for the first conflict among `named` (feature -> its name)."""
    unknown = sorted(set(named) - FEATURES)
    if unknown:
        raise ValueError(f"unknown features {unknown}: declare some of {sorted(FEATURES)}")
    rule = conflict(named)
    if rule is not None:
        raise ValueError(f"{named[rule.a]} with {named[rule.b]}: {rule.reason}")
