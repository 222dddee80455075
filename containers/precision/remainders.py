"""fp32 masters kept as bf16 parameters plus int16 remainders (`store_param_remainders`).

bf16 is the upper half of fp32. Rounding a master by adding half a bf16 ulp to its bits and
keeping the upper half (round half away from zero; torch's `.to` rounds ties to even) leaves
a lower half that, as a signed int16, restores the master exactly: master_bits = (param_bits
<< 16) + remainder (int32 on views of fp32 scratch; both halves lie in [-32768, 32767]).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, LoadPlan, ReadItem

from containers.tensors import local
from containers.update.codecs import join, split

__all__ = ["LoadPlanner", "Sink", "masters_of", "store"]


def masters_of(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """A new fp32 tensor: the masters of a bf16 `param` and its `remainder` (same shape)."""
    bits = param.view(torch.int16).to(torch.int32)
    join(bits, remainder.view(bits.shape))
    return bits.view(torch.float32)


STORE_NUMEL = 1 << 18  # elements `store` splits at a time (its int32 temporary: 1 MiB)


def store(master: torch.Tensor, param: torch.Tensor, remainder: torch.Tensor) -> None:
    """Write fp32 `master` into bf16 `param` and int16 `remainder` (same numel; may be views)."""
    master = master.reshape(param.shape)
    if param.dim() and param.numel() > STORE_NUMEL:
        rows = max(1, STORE_NUMEL * param.shape[0] // param.numel())
        for lo in range(0, param.shape[0], rows):
            store(master[lo : lo + rows], param[lo : lo + rows], remainder[lo : lo + rows])
        return
    bits = master.to(torch.float32).view(torch.int32).clone()
    split(bits, param.view(torch.int16), remainder)


# (write(offsets, fp32 piece), data_ptr of the parameter it writes) of a remainder master
Sink = tuple[Callable[[Sequence[int], torch.Tensor], None], int]


class LoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, writing remainder masters (`sinks`: id(master) -> `Sink`) piece by
    piece into their parameters and remainders, so a resume never holds fp32 masters. Their
    parameters are not read from the model's entry: a saved parameter may have rounded a tie
    to even, and the remainder completes the master's own rounding."""

    def __init__(self, sinks: Mapping[int, Sink]) -> None:
        super().__init__()
        self._by_id = dict(sinks)
        self._sinks: dict[str, Callable[[Sequence[int], torch.Tensor], None]] = {}
        self._skip: set[str] = set()

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:  # type: ignore[override]
        super().set_up_planner(state_dict, metadata, is_coordinator)
        saved = metadata.state_dict_metadata if metadata is not None else {}
        written = set()
        for key, value in self.state_dict.items():
            sink = self._by_id.get(id(value))
            if sink is not None and key in saved:
                self._sinks[key] = sink[0]
                written.add(sink[1])
        self._skip = {
            key
            for key, value in self.state_dict.items()
            if key not in self._sinks
            and isinstance(value, torch.Tensor)
            and local(value).numel()
            and local(value).data_ptr() in written
        }

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = [r for r in plan.items if r.dest_index.fqn not in self._skip]
        return dataclasses.replace(plan, items=items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        if read_item.dest_index.fqn in self._sinks:
            device = self.lookup_tensor(read_item.dest_index).device
            return torch.empty(read_item.lengths, dtype=torch.float32, device=device)
        return super().resolve_tensor(read_item)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        sink = self._sinks.get(read_item.dest_index.fqn)
        if sink is not None:
            sink(read_item.dest_offsets, tensor)
        else:
            super().commit_tensor(read_item, tensor)
