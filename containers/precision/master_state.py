"""`MasterState`: `MasterWeights`' checkpoint entries, each master's exact fp32 value
`master_weights.<fqn>` (so remainders and fp32 masters load each other's) and `loss_scaler.*`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Collection, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from containers.precision.remainders import Sink
from containers.state.flat import describe_keys
from containers.tensors import local

if TYPE_CHECKING:
    from containers.precision.master_weights import MasterWeights

__all__ = ["MasterState"]

MASTER = "master_weights"
SCALER = "loss_scaler"


class MasterState:
    def __init__(self, precision: MasterWeights) -> None:
        self.precision = precision
        self._lazy = False  # `state_dict` gives masters kept as remainders as themselves

    def state_dict(self, fqn_of: dict[torch.Tensor, str]) -> dict[str, Any]:
        flat: dict[str, Any] = {
            f"{MASTER}.{fqn_of[m]}": self._master_value(m) for m in self._masters(fqn_of)
        }
        for key, value in self.precision.scaler.state_dict().items():
            flat[f"{SCALER}.{key}"] = value
        return flat

    def fit_template(self, keys: Collection[str], fqn_of: dict[torch.Tensor, str]) -> None:
        pass

    def forget_template(self) -> None:
        pass

    def _master_value(self, m: torch.Tensor) -> torch.Tensor:
        """Master `m` itself, or (kept as a remainder) a new tensor of its fp32 value."""
        found = self.precision.flat_of.get(id(m))
        return found[0].master_value(found[1]) if found is not None and not self._lazy else m

    @contextlib.contextmanager
    def lazy_masters(self) -> Iterator[dict[int, Sink]]:
        """For a DCP load with `remainders.LoadPlanner`: `state_dict` gives masters kept as
        remainders as themselves, and the yielded sinks write into parameter and remainder."""
        sinks = {
            mid: (functools.partial(flat.load_piece, i), local(flat.model[i]).data_ptr())
            for mid, (flat, i) in self.precision.flat_of.items()
            if flat.remainders
        }
        self._lazy = True
        try:
            yield sinks
        finally:
            self._lazy = False

    def _masters(self, fqn_of: Mapping[torch.Tensor, str]) -> list[torch.Tensor]:
        return [m for m in fqn_of if id(m) in self.precision.model_param]

    def take_state(self, flat: dict[str, Any], fqn_of: dict[torch.Tensor, str]) -> Any:
        masters, scaler, missing, bad = [], {}, [], []
        for m in self._masters(fqn_of):
            key = f"{MASTER}.{fqn_of[m]}"
            if key not in flat:
                missing.append(key)
                continue
            value = flat.pop(key)
            if not isinstance(value, torch.Tensor) or value.shape != m.shape:
                bad.append(key)
            masters.append((m, value))
        for key in self.precision.scaler.state_dict():
            if f"{SCALER}.{key}" not in flat:
                missing.append(f"{SCALER}.{key}")
            else:
                scaler[key] = flat.pop(f"{SCALER}.{key}")
        if missing or bad:
            raise ValueError(
                f"mixed-precision state dict: missing keys {describe_keys(missing)}; "
                f"mismatched master weights {describe_keys(bad)}"
            )
        return masters, scaler

    @torch.no_grad()
    def load_state(self, taken: Any) -> None:
        masters, scaler = taken
        for m, value in masters:
            found = self.precision.flat_of.get(id(m))
            if found is not None and found[0].remainders and value is m:
                continue  # read straight into its parameter and remainder (`lazy_masters`)
            if found is not None:
                found[0].load_master(found[1], local(value))
            else:
                local(m).copy_(local(value))
                local(self.precision.model_param[id(m)]).copy_(local(m))
        self.precision.scaler.load_state_dict(scaler)
        # A replica healing mid-step steps gradients scaled by the scale just received.
        self.precision.unscale = 1.0 / self.precision.scaler.scale
