"""`DiLoCoGate`: DiLoCo across torchft replica groups, its outer state container state.

Each replica group takes its inner steps alone (no gradient average, every step commits);
every `sync_steps` applied steps the groups agree on a quorum, average their pseudo-gradients
(global weights - local weights, in one flat collective) and an outer optimizer (default
torchtitan's: SGD, lr 0.7, momentum 0.9, Nesterov) steps the global weights on the average;
the local weights start the next inner period from them. A sync that does not commit (a peer
failed mid-way) drops the inner period: the local weights go back to the global ones.

The global weights, the outer optimizer's state and the steps done are container state in the
flat format (`outer.global.<fqn>`, `outer.state.<fqn>.<name>`, `outer.inner_steps`, `.outer_steps`),
DTensors placed as their parameters, so they reshard within a replica group and load into a
fresh container as a template, and a whole-job restart in the middle of an inner period goes
on as if it never stopped. Under mixed precision the outer step runs on the fp32 masters.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from containers.gate.agreement import SettingsAgreement
from containers.gate.fault_tolerant import wait_quorum
from containers.norm import local, shaped_like
from containers.parts import Gate, GateLost
from containers.state.flat import describe_keys, flatten_into
from containers.state.initial import derive

if TYPE_CHECKING:
    from torchft import Manager

    from containers.container import OptimizersContainer

__all__ = ["OUTER", "DiLoCoGate", "fragments"]

OUTER = "outer"
"""Prefix of the gate's entries in the flat state dict."""


class DiLoCoGate(Gate):
    """Local inner steps; an outer step on the averaged pseudo-gradient every `sync_steps`.

    Args:
        manager: the replica group's `torchft.Manager`; None: the gate only holds and loads
            its state (an offline load, e.g. to inspect or convert a checkpoint).
        sync_steps: applied inner steps between two outer steps of a fragment.
        outer_cls: the outer optimizer (any `torch.optim` one).
        outer_kwargs: its constructor kwargs; default torchtitan's Nesterov SGD 0.7 / 0.9.
        num_fragments: streaming DiLoCo: the parameters cut into this many fragments of about
            equal size, synced in turn, `sync_steps / num_fragments` steps apart (fragment i
            at steps t with t % sync_steps == (i + 1) * sync_steps // num_fragments %
            sync_steps), so each sync moves 1/num_fragments of the bytes.
        fragment_update_alpha: after a sync, local = alpha * local + (1 - alpha) * global.
        agree_on: settings every replica group must share, compared at each new quorum
            before the average (`SettingsAgreement`; a group that differs is refused with a
            `ConfigError` naming the keys); None: not compared.
        name: this group's name in those messages.
    """

    refusal = "not committed by torchft"

    def __init__(
        self,
        manager: Manager | None,
        *,
        sync_steps: int,
        outer_cls: type[Optimizer] = torch.optim.SGD,
        outer_kwargs: Mapping[str, Any] | None = None,
        num_fragments: int = 1,
        fragment_update_alpha: float = 0.0,
        agree_on: Mapping[str, Any] | None = None,
        name: str = "",
    ) -> None:
        if sync_steps < 1:
            raise ValueError(f"sync_steps = {sync_steps}: use 1 or more inner steps per sync")
        if not 1 <= num_fragments <= sync_steps:
            raise ValueError(
                f"num_fragments = {num_fragments}: use 1 to sync_steps ({sync_steps}) fragments "
                "(each syncs once per sync_steps, on a step of its own)"
            )
        if not 0.0 <= fragment_update_alpha <= 1.0:
            raise ValueError(
                f"fragment_update_alpha = {fragment_update_alpha}: use a weight in [0, 1] of "
                "the local weights against the global ones after a sync"
            )
        self.num_fragments = num_fragments
        self.alpha = fragment_update_alpha
        self.agreement = None if agree_on is None else SettingsAgreement(name, agree_on)
        self.manager = manager
        self.sync_steps = sync_steps
        self.outer_cls = outer_cls
        self.outer_kwargs = (
            dict(outer_kwargs)
            if outer_kwargs is not None
            else {"lr": 0.7, "momentum": 0.9, "nesterov": True}
        )
        self.inner_steps = 0
        self.outer_steps = 0

    def in_backward_conflict(self) -> str | None:
        return (
            "DiLoCo's outer step follows the whole inner step; use the step after backward "
            "(early_step_in_backward = false) or every-step averaging"
        )

    def fsdp1_conflict(self) -> str | None:
        return "DiLoCo's global weights are kept as DTensors like their parameters; use FSDP2"

    def attach(self, container: OptimizersContainer) -> None:
        if getattr(container.precision, "remainders", False):
            raise ValueError(
                "DiLoCo with [mixed_precision] store_param_remainders: the outer step writes "
                "the fp32 masters, which remainders keep only within the flat step; not "
                "supported yet (use store_param_remainders = false)"
            )
        self.container = container
        # What the inner optimizers step: the parameters, or their fp32 masters.
        self.params = [p for group in container.param_groups for p in group["params"]]
        if len(self.params) < self.num_fragments:
            raise ValueError(
                f"num_fragments = {self.num_fragments}: more fragments than the "
                f"{len(self.params)} parameters this rank steps; use fewer"
            )
        with torch.no_grad():
            self.global_ = [p.detach().clone() for p in self.params]
        self.outer = self.outer_cls(self.global_, **self.outer_kwargs)
        self.fragments = fragments([p.numel() for p in self.params], self.num_fragments)
        self.fragment_of = {i: f for f, members in enumerate(self.fragments) for i in members}

    def on_zero_grad(self) -> None:
        # A peer may read this group's state while it heals: not during forward and backward,
        # where FSDP2 swaps the sharded parameters for unsharded ones (see `TorchFTGate`).
        if self.manager is not None:
            self.manager.disallow_state_dict_read()

    def due(self, step: int) -> int | None:
        """The fragment that syncs after inner step `step` (from 1), if one does."""
        k, n = self.sync_steps, self.num_fragments
        for f in range(n):
            if step % k == (f + 1) * k // n % k:
                return f
        return None

    def after_apply(self) -> None:
        self.inner_steps += 1
        fragment = self.due(self.inner_steps)
        if fragment is not None:
            self._sync(self.fragments[fragment])

    @torch.no_grad()
    def _sync(self, members: list[int]) -> None:
        if self.manager is None:
            raise GateLost("DiLoCo's outer step needs a torchft manager (this gate only loads)")
        self.manager.allow_state_dict_read()
        self.manager.start_quorum()
        wait_quorum(self.manager)
        flat = torch.cat([x.reshape(-1) for x in self.pseudo_gradients(members)])
        # A group of another config is refused here (it raises; the others leave it out).
        left = self.agreement.check(self.manager) if self.agreement is not None else None
        if left is None:
            self.manager.allreduce(flat).wait()
        elif left > 1:  # retried at the next sync, without the refused groups
            self.manager.report_error(RuntimeError("a replica group was refused"))
        # (left == 1: alone, its pseudo-gradients are the average)
        self.outer_step(members, flat if self.manager.should_commit() else None)

    def pseudo_gradients(self, members: list[int]) -> list[torch.Tensor]:
        """The pseudo-gradients (local pieces) of the parameters `members` (indices), which
        the outer optimizer descends: global - local weights."""
        return [local(self.global_[i]) - local(self.params[i]) for i in members]

    @torch.no_grad()
    def outer_step(self, members: list[int], averaged: torch.Tensor | None) -> None:
        """Step the global weights `members` on their `averaged` pseudo-gradients (flat, in
        the order of `pseudo_gradients`; None: the sync did not commit, no step) and restart
        their local weights from them (mixed by `fragment_update_alpha`)."""
        if averaged is not None:
            offset = 0
            for i in members:
                g = self.global_[i]
                n = local(g).numel()
                g.grad = shaped_like(averaged[offset : offset + n], g)
                offset += n
            self.outer.step()  # (the other fragments have no gradient: untouched)
            self.outer.zero_grad(set_to_none=True)
            self.outer_steps += 1
        for i in members:
            piece, target = local(self.params[i]), local(self.global_[i])
            if self.alpha:
                piece.lerp_(target, 1.0 - self.alpha)
            else:
                piece.copy_(target)
        self.container.precision.written([self.params[i] for i in members])

    # -- state -----------------------------------------------------------------------------

    def _outer_states(self, materialize: bool = True) -> dict[torch.Tensor, dict[str, Any]]:
        """Each global weight's outer state, or the outer optimizer's start state (so the
        dict is a template before the first outer step too)."""
        fresh = [g for g in self.global_ if not self.outer.state.get(g)]
        derived = derive(self.outer, fresh, materialize).states if fresh else {}
        return {g: self.outer.state.get(g) or derived.get(g, {}) for g in self.global_}

    def state_dict(self, fqn_of: dict[torch.Tensor, str]) -> dict[str, Any]:
        flat: dict[str, Any] = {
            f"{OUTER}.inner_steps": self.inner_steps,
            f"{OUTER}.outer_steps": self.outer_steps,
        }
        states = self._outer_states()
        for i, (p, g) in enumerate(zip(self.params, self.global_)):
            flat[f"{OUTER}.fragment.{fqn_of[p]}"] = self.fragment_of[i]
            flat[f"{OUTER}.global.{fqn_of[p]}"] = g
            flatten_into(flat, f"{OUTER}.state.{fqn_of[p]}", states[g])
        return flat

    def take_state(self, flat: dict[str, Any], fqn_of: dict[torch.Tensor, str]) -> Any:
        taken = {k: flat.pop(k) for k in [k for k in flat if k.startswith(f"{OUTER}.")]}
        expected = {f"{OUTER}.inner_steps", f"{OUTER}.outer_steps"}
        expected |= {f"{OUTER}.global.{fqn_of[p]}" for p in self.params}
        expected |= {f"{OUTER}.fragment.{fqn_of[p]}" for p in self.params}
        if taken.get(f"{OUTER}.outer_steps", 0):
            names = self._outer_states(materialize=False)
            expected |= {
                f"{OUTER}.state.{fqn_of[p]}.{name}"
                for p, g in zip(self.params, self.global_)
                for name in names[g]
            }
        missing = sorted(expected - taken.keys())
        if missing:
            raise ValueError(
                f"DiLoCo state: missing keys {describe_keys(missing)} (a checkpoint of "
                "every-step averaging? start DiLoCo in another dump folder)"
            )
        moved = [
            fqn_of[p]
            for i, p in enumerate(self.params)
            if int(taken[f"{OUTER}.fragment.{fqn_of[p]}"]) != self.fragment_of[i]
        ]
        if moved:
            raise ValueError(
                f"DiLoCo state: parameters {describe_keys(moved)} were in other fragments "
                f"(the checkpoint's num_fragments differs from {self.num_fragments}): their "
                "sync schedule would break; resume with the checkpoint's num_fragments"
            )
        return taken, fqn_of

    @torch.no_grad()
    def load_state(self, taken: Any) -> None:
        flat, fqn_of = taken
        self.inner_steps = int(flat[f"{OUTER}.inner_steps"])
        self.outer_steps = int(flat[f"{OUTER}.outer_steps"])
        self.outer.state.clear()  # before the first outer step: torch's start
        for p, g in zip(self.params, self.global_):
            value = flat[f"{OUTER}.global.{fqn_of[p]}"]
            if value is not g:
                local(g).copy_(local(value))
        if not self.outer_steps:
            return
        names = self._outer_states(materialize=False)
        for p, g in zip(self.params, self.global_):
            state = {}
            for name in names[g]:
                value = flat[f"{OUTER}.state.{fqn_of[p]}.{name}"]
                state[name] = value.clone() if isinstance(value, torch.Tensor) else value
            self.outer.state[g] = state


def fragments(sizes: list[int], n: int) -> list[list[int]]:
    """`n` runs of consecutive indices of `sizes` (parameter numels, in the container's order;
    at least `n`) of about equal total size: the same cut on every rank and replica group
    (global sizes)."""
    total, cuts, acc = sum(sizes), [], 0
    for i, size in enumerate(sizes[:-1]):
        acc += size
        need, left = n - 1 - len(cuts), len(sizes) - i - 1
        if need and (acc >= total * (len(cuts) + 1) / n or left == need):
            cuts.append(i + 1)
    bounds = [0, *cuts, len(sizes)]
    return [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
