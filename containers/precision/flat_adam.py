"""A mixed-precision param group's masters in one flat buffer (fp32 masters, or int16
remainders completing the bf16 parameters) and its moments in the group's codec (fp32, bf16
or 8-bit codes), stepped by the update driver (`containers.update.driver`). Masters are
rebound onto the buffer (`Tensor.set_`) and state entries are the stored moments, so
`state_dict`, DCP, loads and torch's own `step` see torch's layout. A remainder master at rest
is a stride-0 view of one NaN (a stray read is loud).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from containers.precision import remainders as rem
from containers.tensors import local, local_form, scratch_numel, shaped_like
from containers.update.driver import PAD, Slot, Update, run
from containers.update.plan import Plan

__all__ = ["PAD", "FlatGroup"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _padded(n: int) -> int:
    return -(-n // PAD) * PAD


class FlatGroup:
    """One param group's masters (`group`'s params, of the parameters `model`) in a flat
    buffer and its moments in the codec of its `plan`; a step uses up to `chunk_numel` fp32
    scratch elements."""

    @torch.no_grad()
    def __init__(
        self,
        opt: Optimizer,
        group: dict,
        model: Sequence[torch.Tensor],
        plan: Plan,
        *,
        chunk_numel: int | None = None,
    ) -> None:
        # By position: torch's load_state_dict replaces the group dicts.
        self.opt, self.model = opt, list(model)
        self.index = next(i for i, g in enumerate(opt.param_groups) if g is group)
        self.masters: list[torch.Tensor] = list(group["params"])
        pieces = [local(m) for m in self.masters]
        self.sizes = [t.numel() for t in pieces]
        self.starts = [0]
        for n in self.sizes:
            self.starts.append(self.starts[-1] + _padded(n))
        total, first = self.starts[-1], pieces[0]
        where = first.device
        self.plan = plan
        self.codec = plan.moment_codec
        self.remainders = remainders = plan.masters == "remainders"
        self.master_codec = plan.master_codec
        self.buffers = {
            ("remainder" if remainders else "master"): torch.zeros(
                total, dtype=torch.int16 if remainders else first.dtype, device=where
            ),
            # fused kernels want float32 step counts on the parameters' device
            "step": torch.zeros(len(pieces), dtype=torch.float32, device=where),
        }
        self.moments = {k: [self.codec.new(k, m) for m in self.masters] for k in _MOMENTS}
        self.live = list(zip(self.model, self.sizes))
        for i, (piece, start, n) in enumerate(zip(pieces, self.starts, self.sizes)):
            if remainders:
                self.load_master(i, piece)
            else:
                self.buffers["master"][start : start + n].copy_(piece.view(-1))
        self._low_dtype = local(self.model[0]).dtype
        self._empty = [p for p, n in self.live if not n]
        self.budget = chunk_numel or scratch_numel(where)
        # Stale: the optimizer state holds values not yet in the buffers; adopted at next use.
        self.stale = True
        self.uniform: bool | None = None  # all step counts equal; None: not known
        self._rebind()
        self.adopt()  # state entries from the start: DCP loads into them in place

    def chunk(self, numel: int) -> None:
        """Step with `numel` elements of fp32 scratch (so tensors span several runs)."""
        self.budget = numel

    @torch.no_grad()
    def _rebind(self) -> None:
        """Point masters (with remainders: one NaN) and state entries at the buffers."""
        if self.remainders:
            device = self.buffers["remainder"].device
            nan = torch.full((1,), float("nan"), device=device).untyped_storage()
            for m in self.masters:
                piece = local(m)
                shape, stride = piece.shape, (0,) * piece.dim()
                _on(piece, device).set_(nan, 0, shape, stride)
        else:
            master = self.buffers["master"]
            for i, m in enumerate(self.masters):
                piece = local(m)
                shape, stride = piece.shape, piece.stride()
                storage = master.untyped_storage()
                _on(piece, master.device).set_(storage, self.starts[i], shape, stride)
        self.cast_from = [local(m) for m in self.masters]
        self._views: dict[str, list] = dict(self.moments)
        self._views["step"] = [self.buffers["step"][i] for i in range(len(self.masters))]
        # Local pieces for the steps: masters (or remainders) and moments by name.
        kept = "remainder" if self.remainders else "master"
        self.views = {k: [local_form(v) for v in self._views[k]] for k in _MOMENTS}
        self.views[kept] = [
            self.buffers[kept][s : s + n].view(t.shape)
            for s, n, t in zip(self.starts, self.sizes, self.cast_from)
        ]
        if not self.stale:
            self._install()

    def _install(self) -> None:
        for i, m in enumerate(self.masters):
            state = self.opt.state[m]
            for name, views in self._views.items():
                state[name] = views[i]

    @torch.no_grad()
    def adopt(self) -> None:
        """Copy the optimizer state's current values into the buffers and reinstall the views."""
        for i, m in enumerate(self.masters):
            state = self.opt.state.get(m, {})
            for name, views in self._views.items():
                _adopt(state.get(name), views[i])
        self.uniform = None
        self.stale = False
        self._install()

    def master_value(self, i: int) -> torch.Tensor:
        """Master `i`'s fp32 value (a new tensor with remainders)."""
        if not self.remainders:
            return self.masters[i]
        start, n = self.starts[i], self.sizes[i]
        value = rem.masters_of(local(self.model[i]), self.buffers["remainder"][start : start + n])
        return shaped_like(value, self.masters[i])

    @torch.no_grad()
    def load_master(self, i: int, value: torch.Tensor) -> None:
        """Set master `i` to `value` (local piece) and its model parameter to its rounding."""
        if self.remainders:
            self.load_piece(i, (0,) * value.dim(), value)
            return
        local(self.masters[i]).copy_(value)
        local(self.model[i]).copy_(local(self.masters[i]))

    @torch.no_grad()
    def load_piece(self, i: int, offsets: Sequence[int], value: torch.Tensor) -> None:
        """With remainders: fp32 `value` at `offsets` of master `i` into parameter, remainder."""
        shape = local(self.masters[i]).shape
        start, n = self.starts[i], self.sizes[i]
        param = local(self.model[i])
        remainder = self.buffers["remainder"][start : start + n].view(shape)
        for dim, (at, length) in enumerate(zip(offsets, value.shape)):
            param, remainder = param.narrow(dim, at, length), remainder.narrow(dim, at, length)
        rem.store(value, param, remainder)

    @contextlib.contextmanager
    def materialized(self) -> Iterator[None]:
        """With remainders: fp32 masters for the block (torch's own step), split after."""
        if not self.remainders:
            yield
            return
        with torch.no_grad():
            values = [local(self.master_value(i)) for i in range(len(self.masters))]
            for m, v in zip(self.masters, values):
                local(m).set_(v)
        try:
            yield
        finally:
            with torch.no_grad():
                for i, m in enumerate(self.masters):
                    self.load_master(i, local(m))
                self._rebind()

    def move(self, device: torch.device, moved) -> None:
        if self.stale:
            self.adopt()
        self.buffers = {k: moved(v, device) for k, v in self.buffers.items()}
        for views in self.moments.values():
            views[:] = [_moved_form(v, device, moved) for v in views]
        self._rebind()

    def ready(self) -> bool:
        """All tensors have gradients and equal step counts (else torch's own step)."""
        if self.stale:
            self.adopt()
        if self.uniform is None:
            steps = self.buffers["step"]
            self.uniform = bool(steps.eq(steps[0]).all())  # a host sync, only after a change
        # an empty shard may get no gradient
        if self.uniform and all(p.grad is not None for p, n in self.live if n):
            return True
        self.uniform = None
        return False

    @torch.no_grad()
    def step(self, factor: float, found_inf: torch.Tensor | None = None) -> None:
        """Cast, multiply by `factor`, step and write back, on the masters' gradients (fp32
        sums) or the model's, dropping each once cast. A set `found_inf` changes nothing
        (values round-trip exactly through scratch) and restores the step counts."""
        group, buf = self.opt.param_groups[self.index], self.buffers
        decoupled = group.get("decoupled_weight_decay", type(self.opt) is torch.optim.AdamW)
        buf["step"].add_(1)
        grads = [
            local(m.grad if m.grad is not None else p.grad) if n else None
            for (p, n), m in zip(self.live, self.masters)
        ]
        for m in self.masters:
            m.grad = None
        for p in self._empty:
            p.grad = None  # empty: stepped with the rest so its count stays even
        kept = self.views["remainder" if self.remainders else "master"]
        steps = self._views["step"]
        slots = [
            Slot(kept[i], g, [self.views[k][i] for k in _MOMENTS], steps[i],
                 low=local(self.model[i]), index=i)
            for i, g in enumerate(grads)
            if g is not None
        ]  # fmt: skip
        beta1, beta2 = group["betas"]
        hyper = dict(
            lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
            eps=group["eps"], amsgrad=False, maximize=group.get("maximize", False),
        )  # fmt: skip
        # fp32 sums keep the chunked driver: their gradients are the masters' own
        same = all(g is None or g.dtype == self._low_dtype for g in grads)

        def release(i: int) -> None:  # cast: drop the low-precision gradient
            grads[i] = None
            self.model[i].grad = None

        codecs = [(k, self.codec) for k in _MOMENTS]
        update = Update(self.master_codec, codecs, hyper, decoupled, factor, found_inf)
        compiled = self.plan.compiled and same
        run(slots, update, compiled=compiled, release=release, budget=self.budget)
        for p in self.model:
            p.grad = None
        if found_inf is not None:
            buf["step"].sub_(found_inf)


@torch.no_grad()
def _adopt(value: Any, ours: Any) -> None:
    """Copy a state entry's `value` into our stored form `ours` (as it is kept)."""
    if isinstance(ours, dict):
        for k, t in ours.items():
            _adopt(None if value is None else value[k], t)
        return
    view = local(ours)
    if value is None:
        view.zero_()  # no state yet: torch's start (zero moments, step 0)
    elif not isinstance(value, torch.Tensor):
        view.fill_(value)  # a step count saved as a number
    elif local(value).data_ptr() != view.data_ptr():
        view.copy_(local(value))


def _moved_form(stored: Any, device: torch.device, moved) -> Any:
    if isinstance(stored, dict):
        return {k: moved(v, device) for k, v in stored.items()}
    return moved(stored, device)


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` itself, moved to `device` (`set_` refuses a storage on another device)."""
    if t.device != device:
        t.data = torch.empty(0, dtype=t.dtype, device=device)
    return t
