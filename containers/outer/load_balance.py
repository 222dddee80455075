"""`LoadBalance`: DeepSeek-V3's aux-loss-free load balancing of routed experts, as a post-step
part of the container.

Each MoE layer adds a per-expert bias to its routing scores for the top-k selection only, and
its forward adds the token selections each expert received to a count. After a committed step
the counts are summed over every rank of the stage (`group`) and of every replica group that
trains in step with this one (torchft's every-step gate: `manager`), and each bias moves by
`coeff * sign(mean load - load of expert e)`, as torchtitan does in an optimizer step pre-hook.
A step that does not apply leaves the biases as they were, and its counts are dropped when the
next step begins (`on_zero_grad`), so an uncommitted or non-finite step changes nothing. Under
DiLoCo each committed outer step also averages the biases over the replica groups.

The biases are the model's own buffers (saved with its weights, so an exported model routes as
trained); the last committed step's summed counts are flat container state
(`load_balance.<layer>.tokens_per_expert`), equal on every rank, from which `metrics` reports
the load imbalance (max over mean tokens per expert).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from containers.parts import Outer
from containers.state.flat import describe_keys

if TYPE_CHECKING:
    from torchft import Manager

    from containers.container import OptimizersContainer
    from containers.outer.diloco import DiLoCo

__all__ = ["LOAD_BALANCE", "LoadBalance"]

LOAD_BALANCE = "load_balance"
"""Prefix of the part's entries in the flat state dict."""


class LoadBalance(Outer):
    """Expert biases moved towards equal loads after each committed step.

    Args:
        layers: each MoE layer's FQN -> (its bias, its count of this step's token selections),
            both fp32 tensors of one entry per expert, updated in place.
        coeff: how far a bias moves per step; 0 only counts (the imbalance is still reported).
        group: the ranks whose counts add up to the step's (those of this pipeline stage);
            None: the world.
        manager: the replica group's torchft manager under the every-step gate: the counts
            are also summed over the groups of the step's quorum (a healing group adds zeros;
            a failed sum moves no bias); None: one replica group.
        diloco: the job's `DiLoCo` (before this part in the container's outer parts): each of
            its committed outer steps also averages the biases over the replica groups, which
            balance on their own tokens between syncs as their weights drift on their own.
    """

    def __init__(
        self,
        layers: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        coeff: float,
        group: dist.ProcessGroup | None = None,
        manager: Manager | None = None,
        diloco: DiLoCo | None = None,
    ) -> None:
        if not coeff >= 0:
            raise ValueError(f"coeff = {coeff}: use 0 (no balancing) or a positive step")
        self.names = list(layers)
        self.biases = [bias for bias, _ in layers.values()]
        self.counts = [count for _, count in layers.values()]
        self.coeff = coeff
        self.group = group
        self.manager = manager
        self.diloco = diloco
        self._outer_steps = 0  # DiLoCo's outer steps when this step began
        sizes = {t.numel() for t in self.biases + self.counts}
        if len(sizes) > 1:
            raise ValueError(
                f"expert biases and counts of {sizes} sizes: every layer must have one entry "
                "per expert, and the same number of experts"
            )
        self.committed = [torch.zeros_like(c) for c in self.counts]
        self._absent = False  # (fitted to a checkpoint without it: not in the template)

    @property
    def features(self) -> Mapping[str, str]:
        return {}

    def __repr__(self) -> str:
        experts = self.biases[0].numel() if self.biases else 0
        return f"LoadBalance(coeff={self.coeff}, {len(self.names)} layers x {experts} experts)"

    def attach(self, container: OptimizersContainer) -> None:
        """Nothing to bind: the part reads only its layers' buffers."""

    def on_zero_grad(self) -> None:
        """A new step begins: the counts of one that did not apply are dropped."""
        for count in self.counts:
            count.zero_()
        if self.diloco is not None:
            self._outer_steps = self.diloco.outer_steps

    @torch.no_grad()
    def after_apply(self) -> None:
        """Sum the step's counts over the stage's ranks and move each bias towards balance."""
        if not self.counts:
            return
        counts = torch.stack(self.counts)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(counts, group=self.group)
        if self.manager is not None:
            self.manager.allreduce(counts, reduce_op=dist.ReduceOp.SUM).wait()
            if self.manager.errored() is not None:
                counts.zero_()  # (the sum may be torn: no expert is behind another)
        if self.coeff:
            moves = torch.sign(counts.mean(dim=1, keepdim=True) - counts) * self.coeff
            for bias, move in zip(self.biases, moves):
                bias.add_(move.to(bias.dtype))
        for kept, count in zip(self.committed, counts):
            kept.copy_(count)
        diloco = self.diloco
        landed = diloco is not None and diloco.outer_steps > self._outer_steps
        if landed and diloco.manager is not None:  # an outer step landed in this step
            biases = torch.stack(self.biases)
            diloco.manager.allreduce(biases).wait()  # the mean over the quorum's groups
            if diloco.manager.errored() is None:  # (else the sum may be torn: keep ours)
                for bias, mean in zip(self.biases, biases):
                    bias.copy_(mean)

    def metrics(self) -> dict[str, float]:
        """`load_imbalance`: the largest, over layers, of max / mean tokens per expert in the
        last committed step (1.0 is perfect balance); absent before one."""
        if not self.committed:
            return {}
        counts = torch.stack(self.committed)
        means = counts.mean(dim=1)
        if not bool((means > 0).all()):
            return {}
        return {"load_imbalance": float((counts.amax(dim=1) / means).max())}

    # -- state -----------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return f"{LOAD_BALANCE}.{name}.tokens_per_expert"

    def state_dict(self, fqn_of: dict[torch.Tensor, str]) -> dict[str, Any]:
        if self._absent:
            return {}
        return {self._key(n): kept for n, kept in zip(self.names, self.committed)}

    def fit_template(self, keys: Collection[str], fqn_of: dict[torch.Tensor, str]) -> None:
        """A checkpoint without these counts: leave them out of the load template."""
        self._absent = not any(k.startswith(f"{LOAD_BALANCE}.") for k in keys)

    def forget_template(self) -> None:
        self._absent = False

    def take_state(self, flat: dict[str, Any], fqn_of: dict[torch.Tensor, str]) -> Any:
        taken = {k: flat.pop(k) for k in [k for k in flat if k.startswith(f"{LOAD_BALANCE}.")]}
        if not taken:
            return None
        expected = {self._key(n) for n in self.names}
        if missing := sorted(expected - taken.keys()):
            raise ValueError(
                f"load balancing state: missing keys {describe_keys(missing)} (a checkpoint "
                "of other MoE layers? start in another dump folder)"
            )
        for name, kept in zip(self.names, self.committed):
            value = taken[self._key(name)]
            if not isinstance(value, torch.Tensor) or value.shape != kept.shape:
                raise ValueError(
                    f"load balancing state: {self._key(name)} holds "
                    f"{getattr(value, 'shape', type(value).__name__)}, not the {kept.numel()} "
                    "experts of this model: resume with the same number of experts"
                )
        return taken

    @torch.no_grad()
    def load_state(self, taken: Any) -> None:
        self._absent = False
        if taken is None:
            return
        for name, kept in zip(self.names, self.committed):
            value = taken[self._key(name)]
            if value is not kept:
                kept.copy_(value)
