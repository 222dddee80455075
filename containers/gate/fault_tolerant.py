"""`TorchFTGate`: commit-or-skip steps under torchft. `zero_grad()` starts the step's quorum
(it runs while the forward pass does); `step()` averages the gradients across the replica
groups in one flat collective and applies only if the manager commits."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.optim import Optimizer

from containers.container import OptimizersContainer
from containers.parts import Gate
from containers.quorum import wait_quorum
from containers.tensors import local, shaped_like

if TYPE_CHECKING:
    from torchft import Manager

__all__ = ["FTOptimizersContainer", "TorchFTGate"]


class TorchFTGate(Gate):
    """The gate of the torchft replica group of `manager`. `agreement(manager)`, asked at each
    quorum before the average, answers None when every group may average, else the number of
    groups left once others are refused (it raises for this group); `lighthouse` (None:
    `TORCHFT_LIGHTHOUSE`) is quoted by the messages about a missing quorum."""

    refusal = "not committed by torchft"

    def __init__(
        self,
        manager: Manager,
        *,
        agreement: Callable[[Manager], int | None] | None = None,
        lighthouse: str | None = None,
    ) -> None:
        self.manager = manager
        self.lighthouse = lighthouse
        self.agreement = agreement

    @property
    def features(self) -> dict[str, str]:  # type: ignore[override]
        return {"torchft": "TorchFTGate (torchft)"}

    def __repr__(self) -> str:
        return "torchft every step (gradients averaged across replica groups)"

    def on_zero_grad(self) -> None:
        # No state reads by healing peers (from torchft's thread) during forward/backward:
        # FSDP2 unshards the parameters there.
        self.manager.disallow_state_dict_read()
        self.manager.start_quorum()

    @torch.no_grad()
    def reduce_gradients(self, params: Sequence[torch.Tensor]) -> None:
        # Before waiting for the quorum, which may wait to read the state (see on_zero_grad).
        self.manager.allow_state_dict_read()
        wait_quorum(self.manager, lighthouse=self.lighthouse)
        if self.manager.errored() is not None:
            return  # the step commits nowhere (e.g. the quorum's process group did not start)
        if self.agreement is not None and (left := self.agreement(self.manager)):
            # No collective on this quorum's group now. Alone, our gradients are the average;
            # with others, retry in the next quorum without the refused groups.
            if left > 1:
                self.manager.report_error(RuntimeError("a replica group was refused"))
            return
        live = [p for p in params if p.grad is not None]
        if not live or self._alone():
            return
        # In the gradients' own dtype: every group shares one loss scale, so an overflow
        # anywhere is inf/nan on all groups and all skip and back off alike.
        flat = torch.cat([local(p.grad).reshape(-1) for p in live])
        self.manager.allreduce(flat).wait()
        # The gradients become views of the flat buffer (no copy back).
        sizes = [local(p.grad).numel() for p in live]
        for p, view in zip(live, flat.split(sizes)):
            p.grad = shaped_like(view, p.grad)

    def _alone(self) -> bool:
        """The quorum's only replica group (none healing): the average is its own gradients."""
        pg = getattr(self.manager, "_pg", None)  # torchft's replica process group
        return (
            self.manager.num_participants() == 1  # waits for the quorum
            and self.manager.is_participating()
            and pg is not None
            and pg.size() == 1
        )

    def commit(self) -> bool:
        # Waits for the group's slowest rank, which may still be configuring the quorum's
        # process group: the quorum timeout covers that, torchft's default deadline does not.
        return self.manager.should_commit(timeout=getattr(self.manager, "_quorum_timeout", None))


class FTOptimizersContainer(OptimizersContainer):
    """An `OptimizersContainer` with the `TorchFTGate` of `ft_manager`."""

    def __init__(
        self,
        model_parts: Sequence[nn.Module],
        optimizer_cls: type[Optimizer],
        optimizer_kwargs: Mapping[str, Any],
        *,
        ft_manager: Manager,
        **kwargs: Any,
    ) -> None:
        gate = TorchFTGate(ft_manager)
        super().__init__(model_parts, optimizer_cls, optimizer_kwargs, gate=gate, **kwargs)
        self.ft_manager = ft_manager
