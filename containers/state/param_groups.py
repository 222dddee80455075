"""Param groups by FQN pattern: which inner optimizer and settings each parameter gets."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.optim import Optimizer

from containers.parts import Named

__all__ = ["GroupSpecs", "ParamGroupRule", "assign", "dcp_fqn", "matrix_only", "trainable"]

# Wrapper segments that torch's DCP state-dict API leaves out of FQNs.
_WRAPPERS = r"_fsdp_wrapped_module\.|_checkpoint_wrapped_module\.|_orig_mod\."


def dcp_fqn(name: str) -> str:
    """A parameter's name as checkpoints key it: without the wrapper segments of FSDP1,
    activation checkpointing and `torch.compile`, which torch's DCP state-dict API drops."""
    return re.sub(_WRAPPERS, "", name)


# One unit's inner optimizers: class -> (constructor kwargs, [(params, group kwargs)]);
# constructor kwargs hold no group's overrides, so a group never inherits another's.
GroupSpecs = dict[type[Optimizer], tuple[dict[str, Any], list[tuple[list[torch.Tensor], dict]]]]


@dataclass(frozen=True)
class ParamGroupRule:
    """Parameters whose FQN matches `pattern` (`re.search`) form a param group with their own
    `overrides` (e.g. ``{"weight_decay": 0.0}``), or their own `optimizer_cls` in each unit
    (with `optimizer_kwargs`)."""

    pattern: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    optimizer_cls: type[Optimizer] | None = None
    optimizer_kwargs: Mapping[str, Any] | None = None


def _compile(rules: Sequence[ParamGroupRule]) -> list[re.Pattern[str]]:
    compiled = []
    for rule in rules:
        try:
            compiled.append(re.compile(rule.pattern))
        except re.error as e:
            raise ValueError(f"param group pattern {rule.pattern!r} is not a regex: {e}") from None
        if rule.optimizer_cls is not None and rule.optimizer_kwargs is None:
            raise ValueError(
                f"param group {rule.pattern!r} names optimizer_cls "
                f"{rule.optimizer_cls.__name__} without optimizer_kwargs; pass them"
            )
    return compiled


# Suggested in the refusal below: the hidden matrices of a transformer block.
_HIDDEN_MATRICES = r"layers\..*\.(attention|feed_forward)\..*weight"


def matrix_only(cls: type[Optimizer]) -> tuple[int, ...]:
    """The parameter dims `cls` takes if it updates only matrices (Muon orthogonalizes each
    update matrix; `ShardedMuon` also each of a 3-D stack of experts), else ()."""
    return getattr(cls, "matrix_dims", (2,)) if issubclass(cls, torch.optim.Muon) else ()


def _refuse_non_matrices(
    not_2d: dict[int, list[tuple[str, torch.Tensor]]],
    rules: Sequence[ParamGroupRule],
    classes: Sequence[type[Optimizer]],
) -> None:
    if not not_2d:
        return
    where = []
    for i, found in sorted(not_2d.items()):
        group = f"param group {rules[i - 1].pattern!r}" if i else "the default group (no pattern)"
        shown = ", ".join(f"{fqn!r} {tuple(p.shape)}" for fqn, p in found[:4])
        more = f" and {len(found) - 4} more" if len(found) > 4 else ""
        where.append(f"{classes[i].__name__} of {group} got {shown}{more}")
    raise ValueError(
        f"{'; '.join(where)}: it takes only 2-D parameters (it orthogonalizes each update "
        "matrix); match only the hidden matrices to it and give the rest another optimizer, "
        f"e.g. AdamW by default and Muon for the pattern '{_HIDDEN_MATRICES}' "
        "(config: [optimizer] name = 'AdamW' plus [[optimizer.param_groups]] with that "
        "pattern and name = 'Muon')"
    )


def assign(
    units: list[Named],
    rules: Sequence[ParamGroupRule],
    default_cls: type[Optimizer],
    default_kwargs: Mapping[str, Any],
    first_match: bool = False,
) -> list[GroupSpecs]:
    """Map each unit's parameters to groups by the rules; refuse what cannot step.

    `first_match`: the rules are ordered and a parameter joins the first that matches (as
    torchtitan's `param_groups`); else one matching several is refused (disjoint rules)."""
    compiled = _compile(rules)
    # By bucket: 0 is the default group, i > 0 rule i - 1's group.
    classes = [default_cls, *(r.optimizer_cls or default_cls for r in rules)]
    not_2d: dict[int, list[tuple[str, torch.Tensor]]] = {}
    used = [False] * len(rules)
    assigned = []
    for named in units:
        buckets: list[list[torch.Tensor]] = [[] for _ in range(len(rules) + 1)]
        for fqn, p in named:
            hits = [i for i, rx in enumerate(compiled) if rx.search(fqn)]
            if len(hits) > 1 and not first_match:
                raise ValueError(
                    f"parameter {fqn!r} matches param group patterns "
                    f"{[rules[i].pattern for i in hits]}; make the patterns disjoint"
                )
            if hits:
                used[hits[0]] = True
            bucket = hits[0] + 1 if hits else 0
            if matrix_only(classes[bucket]) and p.dim() not in matrix_only(classes[bucket]):
                not_2d.setdefault(bucket, []).append((fqn, p))
            buckets[bucket].append(p)
        groups: GroupSpecs = {}
        for i, params in enumerate(buckets):
            if not params:
                continue
            rule = rules[i - 1] if i else None
            cls = classes[i]
            base = dict((rule and rule.optimizer_kwargs) or default_kwargs)
            # (rules sharing a class of their own share the first one's constructor kwargs)
            constructor = dict(default_kwargs) if cls is default_cls else base
            kwargs = {**base, **(rule.overrides if rule else {})}
            groups.setdefault(cls, (constructor, []))[1].append((params, kwargs))
        assigned.append(groups)
    _refuse_non_matrices(not_2d, rules, classes)
    unused = [r.pattern for r, u in zip(rules, used) if not u]
    if unused:
        raise ValueError(
            f"param group patterns {unused} match no trainable parameter"
            f"{' that an earlier pattern does not take' if first_match else ''}; fix or "
            "remove them"
        )
    return assigned


def trainable(model_parts: Sequence[nn.Module]) -> list[Named]:
    """Each part's trainable (FQN as DCP writes it, parameter) pairs; unique across parts."""
    owner: dict[torch.Tensor, int] = {}
    fqn_owner: dict[str, int] = {}
    parts = []
    for part_idx, part in enumerate(model_parts):
        named = []
        for name, p in part.named_parameters():
            if not p.requires_grad:
                continue
            fqn = dcp_fqn(name)
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
            named.append((fqn, p))
        parts.append(named)
    return parts
