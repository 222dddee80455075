"""`DiLoCo`: DiLoCo across torchft replica groups, an outer part of the container. A sync
that does not commit drops the inner period (local weights back to the global ones). Its state
is flat container state placed as the parameters (ARCHITECTURE.md), so it reshards.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from containers.parts import GateLost, Outer
from containers.quorum import wait_quorum
from containers.state.flat import describe_keys, flatten_into
from containers.state.initial import derive
from containers.tensors import local, shaped_like

if TYPE_CHECKING:
    from torchft import Manager

    from containers.container import OptimizersContainer

__all__ = ["OUTER", "DiLoCo", "OtherFragments", "fragments"]

OUTER = "outer"  # prefix of DiLoCo's entries in the flat state dict


class OtherFragments(ValueError):
    """A checkpoint whose parameters were cut into `saved` fragments, not `configured`."""

    def __init__(self, saved: int, configured: int, moved: str) -> None:
        super().__init__(
            f"DiLoCo state: num_fragments = {configured}, the checkpoint's {saved}: parameters "
            f"{moved} were in other fragments, so their sync schedule would break; resume "
            f"with num_fragments = {saved}"
        )
        self.saved, self.configured = saved, configured


class DiLoCo(Outer):
    """Local inner steps; an outer step on the averaged pseudo-gradient every `sync_steps`
    (`manager` None: it only holds and loads state). `num_fragments` (streaming DiLoCo) are
    synced in turn `sync_steps / num_fragments` steps apart; after a sync local = alpha * local
    + (1 - alpha) * global; `agreement` and `lighthouse` as `TorchFTGate`'s."""

    def __init__(
        self,
        manager: Manager | None,
        *,
        sync_steps: int,
        outer_cls: type[Optimizer] = torch.optim.SGD,
        outer_kwargs: Mapping[str, Any] | None = None,
        num_fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        agreement: Callable[[Manager], int | None] | None = None,
        lighthouse: str | None = None,
    ) -> None:
        if sync_steps < 1:
            raise ValueError(f"sync_steps = {sync_steps}: use 1 or more inner steps per sync")
        if not 1 <= num_fragments <= sync_steps:
            raise ValueError(
                f"num_fragments = {num_fragments}: use 1 to sync_steps ({sync_steps}) fragments "
                "(each syncs once per sync_steps, on a step of its own)"
            )
        if not 0 <= fragment_sync_delay < sync_steps // num_fragments:
            raise ValueError(
                f"fragment_sync_delay = {fragment_sync_delay}: use 0 to "
                f"{sync_steps // num_fragments - 1} (a fragment's average lands before the "
                "next fragment's is taken)"
            )
        if manager is not None and getattr(manager, "_use_async_quorum", False):
            raise ValueError(
                "DiLoCo needs a torchft Manager with use_async_quorum=False (as torchft's "
                "own DiLoCo): a healing group takes its peer's state at the sync's quorum, "
                "before its pseudo-gradients (components.ft.build_ft_manager does so for "
                "semi_sync_method = 'diloco')"
            )
        if not 0.0 <= fragment_update_alpha <= 1.0:
            raise ValueError(
                f"fragment_update_alpha = {fragment_update_alpha}: use a weight in [0, 1] of "
                "the local weights against the global ones after a sync"
            )
        self.num_fragments = num_fragments
        self.delay = fragment_sync_delay
        self.alpha = fragment_update_alpha
        self.lighthouse = lighthouse
        self.agreement = agreement
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
        self.in_flight = -1  # the fragment whose committed average waits to land
        self.pending: dict[int, torch.Tensor] = {}  # that average (or templates) by index
        # With a delay: the average on its way (fragment, flat buffer, torchft work).
        self._flight: tuple[int, torch.Tensor, Any] | None = None
        self._in_quorum = False  # torchft reads the state for a healing peer only then
        self._served = False

    @property
    def features(self) -> dict[str, str]:  # type: ignore[override]
        return {"torchft": "DiLoCo (torchft)", "diloco": "DiLoCo"}

    def __repr__(self) -> str:
        kwargs = ", ".join(f"{k}={v}" for k, v in self.outer_kwargs.items())
        return (
            f"DiLoCo(sync_steps={self.sync_steps}, num_fragments={self.num_fragments}, "
            f"fragment_sync_delay={self.delay}, fragment_update_alpha={self.alpha}, "
            f"outer {self.outer_cls.__name__}({kwargs}))"
        )

    def attach(self, container: OptimizersContainer) -> None:
        self.container = container
        # the stepped tensors (maybe fp32 masters, whose model parameters follow them)
        self.params = [p for group in container.param_groups for p in group["params"]]
        model = {id(s): p for u in container.units for p, s in zip(u.params, u.stepped)}
        self.model = [model[id(s)] for s in self.params]
        if len(self.params) < self.num_fragments:
            raise ValueError(
                f"num_fragments = {self.num_fragments}: more fragments than the "
                f"{len(self.params)} parameters this rank steps; use fewer"
            )
        self.precision = container.precision
        with torch.no_grad():
            self.global_ = [self.precision.weight(p).detach().clone() for p in self.params]
        self.outer = self.outer_cls(self.global_, **self.outer_kwargs)
        self.fragments = fragments([p.numel() for p in self.params], self.num_fragments)
        self.fragment_of = {i: f for f, members in enumerate(self.fragments) for i in members}

    def on_zero_grad(self) -> None:
        # No state reads by healing peers during forward/backward (FSDP2 unshards there).
        if self.manager is not None:
            self.manager.disallow_state_dict_read()

    def due(self, step: int) -> int | None:
        """The fragment that syncs after inner step `step` (from 1), if one does."""
        k, n = self.sync_steps, self.num_fragments
        for f in range(n):
            if step % k == (f + 1) * k // n % k:
                return f
        return None

    def metrics(self) -> dict[str, float]:
        return {}

    def after_apply(self) -> None:
        self.inner_steps += 1
        if self.due(self.inner_steps + self.delay) is not None:
            self._average()
        fragment = self.due(self.inner_steps)
        if fragment is not None:
            self._land(fragment)

    @torch.no_grad()
    def _average(self) -> None:
        """Start averaging the fragment due `delay` steps from now (lands if committed)."""
        if self.manager is None:
            raise GateLost("DiLoCo's outer step needs a torchft manager (this one only loads)")
        self.manager.allow_state_dict_read()
        self._in_quorum, self._served = True, False
        try:
            wait_quorum(self.manager, start=True, lighthouse=self.lighthouse)
        finally:
            self._in_quorum = False
        # (after a heal, the schedule is the peer's)
        fragment = self.due(self.inner_steps + self.delay)
        flat = torch.cat([x.reshape(-1) for x in self.pseudo_gradients(self.fragments[fragment])])
        # A group of another config is refused here (it raises; the others leave it out).
        left = self.agreement(self.manager) if self.agreement is not None else None
        work = self.manager.allreduce(flat) if left is None else None
        if left is not None and left > 1:  # retried at the next sync, without the refused
            self.manager.report_error(RuntimeError("a replica group was refused"))
        # (left == 1: alone, its pseudo-gradients are the average)
        self._flight = (fragment, flat, work)
        # A healing peer reads this group's state until the average completes (torchft
        # serves tensors by reference, after this quorum): no inner step before then.
        if not self.delay or self._served:
            self._decide()

    def _decide(self) -> None:
        """Wait for the average on its way; keep it to land if this group commits it."""
        fragment, flat, work = self._flight
        self._flight = None
        if work is not None:
            work.wait()
        if self.manager.should_commit():
            self.in_flight = fragment
            self.pending = self._averages(fragment, flat)

    def _averages(self, fragment: int, flat: torch.Tensor) -> dict[int, torch.Tensor]:
        members = self.fragments[fragment]
        sizes = [local(self.global_[i]).numel() for i in members]
        return {
            i: shaped_like(piece, self.global_[i]) for i, piece in zip(members, flat.split(sizes))
        }

    def pseudo_gradients(self, members: list[int]) -> list[torch.Tensor]:
        """Global - local weights (local pieces) of the parameters at indices `members`."""
        weight = self.precision.weight
        return [local(self.global_[i]) - local(weight(self.params[i])) for i in members]

    @torch.no_grad()
    def _land(self, fragment: int) -> None:
        """Outer-step `fragment` if its average committed; restart its local weights."""
        if self._flight is not None:
            self._decide()
        members = self.fragments[fragment]
        landed = self.in_flight == fragment
        if landed:
            for i in members:
                self.global_[i].grad = self.pending[i]
            self.outer.step()  # (the other fragments have no gradient: untouched)
            self.outer.zero_grad(set_to_none=True)
            self.outer_steps += 1
        self.in_flight, self.pending = -1, {}
        for i in members:
            target = local(self.global_[i])
            if landed and self.alpha:
                piece = local(self.precision.weight(self.params[i])).lerp_(target, 1 - self.alpha)
            else:
                piece = target
            self.precision.set_weight(self.params[i], piece)

    def _outer_states(self, materialize: bool = True) -> dict[torch.Tensor, dict[str, Any]]:
        """Each global weight's outer state, or its start state (a template before step 1)."""
        fresh = [g for g in self.global_ if not self.outer.state.get(g)]
        derived = derive(self.outer, fresh, materialize).states if fresh else {}
        return {g: self.outer.state.get(g) or derived.get(g, {}) for g in self.global_}

    def state_dict(self, fqn_of: dict[torch.Tensor, str]) -> dict[str, Any]:
        if self._in_quorum:
            self._served = True  # (torchft's quorum thread, for a peer that heals from us)
        in_flight, pending = self.in_flight, self.pending
        if self._flight is not None:
            # An average on its way completes on every group: save it as landing, unless
            # this group saw it fail (its commit would drop it).
            fragment, averaged, work = self._flight
            if work is not None:
                work.wait()
            if self.manager is None or not self.manager.errored():
                in_flight, pending = fragment, self._averages(fragment, averaged)
        flat: dict[str, Any] = {
            f"{OUTER}.inner_steps": self.inner_steps,
            f"{OUTER}.outer_steps": self.outer_steps,
            f"{OUTER}.in_flight": in_flight,
        }
        for i, average in pending.items():
            flat[f"{OUTER}.pending.{fqn_of[self.params[i]]}"] = average
        states = self._outer_states()
        for i, (p, g) in enumerate(zip(self.params, self.global_)):
            flat[f"{OUTER}.fragment.{fqn_of[p]}"] = self.fragment_of[i]
            flat[f"{OUTER}.global.{fqn_of[p]}"] = g
            flatten_into(flat, f"{OUTER}.state.{fqn_of[p]}", states[g])
        return flat

    def fit_template(self, keys: Collection[str], fqn_of: dict[torch.Tensor, str]) -> None:
        if self.in_flight < 0:
            self.pending = {
                i: torch.zeros_like(g)
                for i, (p, g) in enumerate(zip(self.params, self.global_))
                if f"{OUTER}.pending.{fqn_of[p]}" in keys
            }

    def forget_template(self) -> None:
        if self.in_flight < 0:
            self.pending = {}

    def take_state(self, flat: dict[str, Any], fqn_of: dict[torch.Tensor, str]) -> Any:
        taken = {k: flat.pop(k) for k in [k for k in flat if k.startswith(f"{OUTER}.")]}
        expected = {f"{OUTER}.inner_steps", f"{OUTER}.outer_steps", f"{OUTER}.in_flight"}
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
        saved = [int(taken[f"{OUTER}.fragment.{fqn_of[p]}"]) for p in self.params]
        moved = [fqn_of[p] for i, p in enumerate(self.params) if saved[i] != self.fragment_of[i]]
        if moved:
            raise OtherFragments(max(saved) + 1, self.num_fragments, describe_keys(moved))
        in_flight = int(taken[f"{OUTER}.in_flight"])
        if not -1 <= in_flight < self.num_fragments:
            raise ValueError(
                f"DiLoCo state: outer.in_flight = {in_flight}: not a fragment of "
                f"{self.num_fragments}; resume with the checkpoint's num_fragments"
            )
        if in_flight >= 0:
            members = self.fragments[in_flight]
            pending = {f"{OUTER}.pending.{fqn_of[self.params[i]]}" for i in members}
            if missing := sorted(pending - taken.keys()):
                raise ValueError(
                    f"DiLoCo state: fragment {in_flight}'s average waits to land but "
                    f"{describe_keys(missing)} did not load: fit the template to the "
                    "checkpoint first (container.check_checkpoint_keys(its keys), as the "
                    "checkpoint manager does)"
                )
        return taken, fqn_of

    @torch.no_grad()
    def load_state(self, taken: Any) -> None:
        flat, fqn_of = taken
        self.inner_steps = int(flat[f"{OUTER}.inner_steps"])
        self.outer_steps = int(flat[f"{OUTER}.outer_steps"])
        self.in_flight, self._flight = int(flat[f"{OUTER}.in_flight"]), None
        templates, self.pending = self.pending, {}
        if self.in_flight >= 0:
            for i in self.fragments[self.in_flight]:
                value = flat[f"{OUTER}.pending.{fqn_of[self.params[i]]}"]
                # (a template of ours holds it already; a peer's or a caller's is copied)
                self.pending[i] = value if value is templates.get(i) else value.clone()
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
    """`n` runs of indices of `sizes` of about equal total size (same on every rank)."""
    total, cuts, acc = sum(sizes), [], 0
    for i, size in enumerate(sizes[:-1]):
        acc += size
        need, left = n - 1 - len(cuts), len(sizes) - i - 1
        if need and (acc >= total * (len(cuts) + 1) / n or left == need):
            cuts.append(i + 1)
    bounds = [0, *cuts, len(sizes)]
    return [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
