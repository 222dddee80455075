"""The CPU copy an async save writes from, taken before training goes on.

DCP's own stager (`StateDictStager`) copies a tensor's whole storage and decides whether a
tensor has one by `data_ptr() != 0`. A DTensor is a wrapper with no storage of its own, but it
takes its local tensor's storage offset: where the local tensor is a view into a flat buffer
(the mixed-precision masters and moments, `containers.precision.flat_adam`), the wrapper's
`data_ptr()` is that offset times the element size, not 0, and the stager tries to copy the
wrapper's empty storage ("Attempted to call copy_() on an invalid python storage"). Here the
stager copies the local tensors instead and the DTensors are rebuilt around the copies: views
of one buffer still share one staged copy of it (the stager's memo), so the CPU memory is one
copy of what is saved, as for any other tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["Staged", "Stager"]


class Stager:
    """Copies state dicts to CPU for async saves.

    Args:
        keep: keep the CPU copies between saves and copy into them again
            (`async_with_pinned_mem`: no allocation per save, the memory held for the run);
            otherwise each copy is freed once its save is written.
        pin: pin the copies (only where CUDA is: page-locked memory copies from the GPU at
            full speed).
    """

    def __init__(self, keep: bool = False, pin: bool = False) -> None:
        self.keep, self.pin = keep, pin
        self._kept: StateDictStager | None = None

    @torch.no_grad()
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A CPU copy of `state_dict` (nested dicts of tensors, DTensors and plain values)."""
        leaves, spec = tree_flatten(state_dict)
        plain = [x._local_tensor if isinstance(x, DTensor) else x for x in leaves]
        stager = self._kept or StateDictStager(pin_memory=self.pin)
        try:
            copied = stager.stage(plain)
        finally:
            if self.keep:
                self._kept = stager
            else:
                stager.close()  # its cache only: the copies live as long as the result
        staged = [
            DTensor(c, x._spec, requires_grad=False) if isinstance(x, DTensor) else c
            for x, c in zip(leaves, copied, strict=True)
        ]
        return tree_unflatten(staged, spec)

    def close(self) -> None:
        """Free the copies kept between saves."""
        if self._kept is not None:
            self._kept.close()
            self._kept = None


class Staged(AsyncStager):
    """What `dcp.async_save` stages with when the state dict is a `Stager` copy already."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """`state_dict` itself."""
        return state_dict
