"""`ShadowWeights`: an exponential moving average of the weights the container steps (fp32
masters under mixed precision), saved as `ema.<fqn>` and `ema.steps` (applied steps seen).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence

import torch

from containers.state.flat import describe_keys
from containers.tensors import local

__all__ = ["EMA", "ShadowWeights"]

EMA = "ema"  # prefix of the average's entries in the flat state dict
_READ_AT_ONCE = 32  # weights read (maybe decoded) for one foreach call

logger = logging.getLogger(__name__)


class ShadowWeights:
    """ema = decay * ema + (1 - decay) * w at every `update_every_n_steps`-th applied step
    after `start_step`; until then the average is the weights themselves."""

    def __init__(self, decay: float, *, update_every_n_steps: int = 1, start_step: int = 0) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(
                f"decay = {decay}: use a weight in [0, 1) of the average against the weights"
            )
        if update_every_n_steps < 1:
            raise ValueError(f"update_every_n_steps = {update_every_n_steps}: use 1 or more steps")
        if start_step < 0:
            raise ValueError(f"start_step = {start_step}: use 0 or more applied steps")
        self.decay = decay
        self.every = update_every_n_steps
        self.start_step = start_step
        self.steps = 0
        self.params: list[torch.Tensor] = []
        self.shadow: list[torch.Tensor] = []
        self._index: dict[int, int] = {}
        # Restart from the loaded weights at first use (they may load after the optimizer).
        self._from_weights = False
        self._absent = False  # (fitted to a checkpoint without it: not in the template)

    def __repr__(self) -> str:
        return (
            f"ShadowWeights(decay={self.decay}, update_every_n_steps={self.every}, "
            f"start_step={self.start_step})"
        )

    @torch.no_grad()
    def attach(
        self,
        params: Sequence[torch.Tensor],
        read: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Average `params`, each read through `read` (the precision's `weight`: fp32
        masters decoded from remainders; default: the tensor itself)."""
        self.params = list(params)
        self.read = read if read is not None else (lambda p: p)
        self.shadow = [self.read(p).detach().clone() for p in self.params]
        self._index = {id(p): i for i, p in enumerate(self.params)}

    def _weight(self, n: int) -> float | None:
        """The lerp weight of applied step `n` (1.0: a copy; None: no update)."""
        if n <= self.start_step:
            return 1.0
        if (n - self.start_step) % self.every == 0:
            return 1.0 - self.decay
        return None

    @torch.no_grad()
    def update(self, params: Sequence[torch.Tensor] | None = None) -> None:
        """Fold `params` (default: all) into the average for the step `count()` will count."""
        self._settle()
        weight = self._weight(self.steps + 1)
        if weight is not None:
            every = range(len(self.params))
            self._fold(every if params is None else [self._index[id(p)] for p in params], weight)

    @torch.no_grad()
    def _fold(self, index: Iterable[int], weight: float) -> None:
        index = list(index)
        for at in range(0, len(index), _READ_AT_ONCE):  # (a decoded read is a new tensor)
            run = index[at : at + _READ_AT_ONCE]
            shadow = [local(self.shadow[i]) for i in run]
            weights = [local(self.read(self.params[i])) for i in run]
            if weight == 1.0:
                torch._foreach_copy_(shadow, weights)
            else:
                torch._foreach_lerp_(shadow, weights, weight)

    def averages(self) -> list[torch.Tensor]:
        """The average of each of `params` (live tensors)."""
        self._settle()
        return self.shadow

    def restart(self, why: str) -> None:
        """Start over at step 0 from the weights as they are at the next use."""
        logger.info("%s: it starts from the loaded weights", why)
        self._from_weights, self.steps = True, 0

    def count(self) -> None:
        self.steps += 1

    def _settle(self) -> None:
        if self._from_weights:
            self._from_weights = False
            self._fold(range(len(self.params)), 1.0)

    @contextlib.contextmanager
    def swapped_into(self, targets: Sequence[torch.Tensor]) -> Iterator[None]:
        """`targets` (the model parameters of `params`) hold the average inside the block."""
        self._settle()
        pieces = [local(t) for t in targets]
        with torch.no_grad():
            kept = [p.clone() for p in pieces]
            for piece, s in zip(pieces, self.shadow):
                piece.copy_(local(s))
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(pieces, kept)

    def state_dict(self, fqn_of: dict[torch.Tensor, str]) -> dict[str, object]:
        if self._absent:
            return {}
        self._settle()
        flat: dict[str, object] = {f"{EMA}.steps": self.steps}
        for p, s in zip(self.params, self.shadow):
            flat[f"{EMA}.{fqn_of[p]}"] = s
        return flat

    def fit_template(self, keys: Collection[str], fqn_of: dict[torch.Tensor, str]) -> None:
        self._absent = not any(k.startswith(f"{EMA}.") for k in keys)

    def forget_template(self) -> None:
        self._absent = False

    def take_state(self, flat: dict[str, object], fqn_of: dict[torch.Tensor, str]) -> object:
        taken = {k: flat.pop(k) for k in [k for k in flat if k.startswith(f"{EMA}.")]}
        if not taken:
            return None  # (`load_state` starts the average from the loaded weights)
        expected = {f"{EMA}.steps"} | {f"{EMA}.{fqn_of[p]}" for p in self.params}
        if missing := sorted(expected - taken.keys()):
            raise ValueError(
                f"EMA state: missing keys {describe_keys(missing)} (a checkpoint of other "
                "parameters? start in another dump folder)"
            )
        return taken, fqn_of

    @torch.no_grad()
    def load_state(self, taken: object) -> None:
        self._absent = False
        if taken is None:
            self.restart("the checkpoint holds no EMA (ema.*)")
            return
        flat, fqn_of = taken
        self.steps = int(flat[f"{EMA}.steps"])
        for p, s in zip(self.params, self.shadow):
            value = flat[f"{EMA}.{fqn_of[p]}"]
            if value is not s:
                local(s).copy_(local(value))
