"""fp32 masters kept as bf16 parameters plus 16-bit remainders (`store_param_remainders`).

bf16 is the upper half of fp32 (same sign and exponent bits), so an fp32 master is its bf16
parameter's 16 bits and 16 more. Rounding the master to the parameter by adding half a bf16
ulp to its bits and keeping the upper half (round half away from zero; torch's `.to` rounds
ties to even, which differs only where the lower half is exactly 0x8000) leaves a lower half
that, read as a signed int16, makes the master again exactly:

    master_bits = (param_bits << 16) + remainder      (int32, two's complement)

So 2 bytes a parameter hold what the 4-byte master held, bit for bit. The arithmetic is in
int32 on views of fp32 scratch (products and sums stay inside int32 for every finite master:
`param_bits` is in [-32768, 32767] and `remainder` in [-32768, 32767]).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, LoadPlan, ReadItem

from containers.tensors import local

__all__ = ["HALF_ULP", "LoadPlanner", "Sink", "join", "masters_of", "split", "store"]

HALF_ULP = 0x8000
"""Half a bf16 ulp in the low bits of an fp32's bit pattern."""


def join(bits: torch.Tensor, remainder: torch.Tensor) -> None:
    """`bits` (int32) holds the parameters' bf16 bits, sign-extended: make it the masters'
    fp32 bits by adding their `remainder` (int16)."""
    torch.add(remainder, bits, alpha=1 << 16, out=bits)  # one pass (a shift, then an add: two)


def split(bits: torch.Tensor, high: torch.Tensor) -> None:
    """`bits` (int32) holds the masters' fp32 bits: `high` (int32) becomes the rounded
    parameters' bf16 bits and `bits` the remainders (both within int16's range)."""
    torch.add(bits, HALF_ULP, out=high).bitwise_right_shift_(16)
    bits.sub_(high, alpha=1 << 16)


def masters_of(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """A new fp32 tensor: the masters of a bf16 `param` and its `remainder` (same shape)."""
    bits = param.view(torch.int16).to(torch.int32)
    join(bits, remainder.view(bits.shape))
    return bits.view(torch.float32)


STORE_NUMEL = 1 << 18
"""Elements `store` splits at a time (its int32 temporaries: 2 MiB, not a tensor's size)."""


def store(master: torch.Tensor, param: torch.Tensor, remainder: torch.Tensor) -> None:
    """Write an fp32 `master` into a bf16 `param` and its int16 `remainder` (same numel;
    the targets may be views, e.g. a piece of a larger tensor)."""
    master = master.reshape(param.shape)
    if param.dim() and param.numel() > STORE_NUMEL:
        rows = max(1, STORE_NUMEL * param.shape[0] // param.numel())
        for lo in range(0, param.shape[0], rows):
            store(master[lo : lo + rows], param[lo : lo + rows], remainder[lo : lo + rows])
        return
    bits = master.to(torch.float32).view(torch.int32).clone()
    high = torch.empty_like(bits)
    split(bits, high)
    param.view(torch.int16).copy_(high)
    remainder.copy_(bits)


Sink = tuple[Callable[[Sequence[int], torch.Tensor], None], int]
"""How a master kept as a remainder takes a piece read from a checkpoint: `write(offsets,
fp32 piece)` (offsets within the master's local piece), and the `data_ptr` of the parameter
that writes (which the checkpoint's model entry must then not overwrite)."""


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but masters kept as remainders are read piece by piece
    into an fp32 buffer of that piece and written straight into their parameters and
    remainders: a resume never holds the masters in fp32 (the state dict's template for such
    a master is the master itself, `MasterWeights.lazy_masters`). A parameter that a
    master writes is not read again from the model's entry: the master's rounding is the
    one its remainder completes (a saved parameter may have rounded a tie to even).

    Args:
        sinks: id(master) -> its `Sink`.
    """

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
