"""Masters and Adam state of a param group in flat buffers (one fused call per chunk, not per
tensor). Masters are rebound onto them (`Tensor.set_`) and state entries are views, so
`state_dict`, DCP, loads and torch's own `step` see torch's layout. Tensors start on
`PAD`-element boundaries, so every element takes the kernel's vector path: results do not
depend on chunking and equal torch's per-tensor fused step bitwise for sizes that are
multiples of `PAD`. A remainder master at rest is a stride-0 view of one NaN (a stray read is
loud).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch.optim import Optimizer

from containers.optim.compiled_adam import compiled_adam
from containers.optim.lean import moment_dtype_of
from containers.optim.lean_adam import ADAMS
from containers.optim.paths import BF16_FUSED_DEVICES
from containers.precision import remainders as rem
from containers.tensors import local, scratch, scratch_numel, shaped_like

__all__ = ["PAD", "FlatGroup", "eligible"]

PAD = 64  # a multiple of every CPU vector width and of the fused kernel's per-thread split

_MOMENTS = ("exp_avg", "exp_avg_sq")


def eligible(opt: Optimizer, group: dict) -> bool:
    """Whether `group` of `opt` can step flat: fused Adam/AdamW, no amsgrad, not
    differentiable, its parameters contiguous and on one device."""
    params = group["params"]
    if type(opt) not in ADAMS or not params or not group["fused"]:
        return False
    if group.get("amsgrad") or group.get("differentiable"):
        return False
    pieces = [local(p) for p in params]
    return all(t.is_contiguous() for t in pieces) and len({t.device for t in pieces}) == 1


def _padded(n: int) -> int:
    return -(-n // PAD) * PAD


class FlatGroup:
    """One param group's masters (`group`'s params, of the parameters `model`) and Adam state
    as views of flat buffers; a chunk uses up to `chunk_numel` fp32 scratch elements."""

    @torch.no_grad()
    def __init__(
        self,
        opt: Optimizer,
        group: dict,
        model: Sequence[torch.Tensor],
        *,
        chunk_numel: int | None = None,
        remainders: bool = False,
    ) -> None:
        if group.get("moment_dtype") == "8bit":
            raise ValueError(
                "moment_dtype = '8bit' under mixed precision: its moments live in flat "
                "buffers that a chunk cuts anywhere, not in rows of blocks; use moment_dtype "
                "= 'bfloat16' (with store_param_remainders: 8 bytes a parameter)"
            )
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
        moment = moment_dtype_of(group)
        where = first.device
        self.lean = moment != first.dtype
        # moments widened into scratch for the kernel, unless torch's takes them as they are
        self.widened = self.lean and where.type not in BF16_FUSED_DEVICES
        self.remainders = remainders
        # fp32 scratch regions a chunk takes: gradients, then masters and moments if narrower
        self.regions = 1 + remainders + 2 * self.widened
        self.buffers = {
            ("remainder" if remainders else "master"): torch.zeros(
                total, dtype=torch.int16 if remainders else first.dtype, device=where
            ),
            **{k: torch.zeros(total, dtype=moment, device=where) for k in _MOMENTS},
            # fused kernels want float32 step counts on the parameters' device
            "step": torch.zeros(len(pieces), dtype=torch.float32, device=where),
        }
        self.live = list(zip(self.model, self.sizes))
        for i, (piece, start, n) in enumerate(zip(pieces, self.starts, self.sizes)):
            if remainders:
                self.load_master(i, piece)
            else:
                self.buffers["master"][start : start + n].copy_(piece.view(-1))
        self._low_dtype = local(self.model[0]).dtype
        self._empty = [p for p, n in self.live if not n]
        self.chunk((chunk_numel or scratch_numel(where)) // self.regions)
        # Stale: the optimizer state holds values not yet in the buffers; adopted at next use.
        self.stale = True
        self.uniform: bool | None = None  # all step counts equal; None: not known
        self._rebind()
        self.adopt()  # state views from the start: DCP loads into them in place

    def chunk(self, numel: int) -> None:
        self.chunks = self._plan(max(PAD, numel // PAD * PAD))
        # per chunk: the tensors whose last piece it holds
        self.done = [[i for i, _, hi in c[2] if hi == self.sizes[i]] for c in self.chunks]
        self._views_of: dict[tuple, tuple] = {}

    def _plan(self, limit: int) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
        """Chunks (start, stop, pieces (i, lo, hi)) of at most `limit`, cut between tensors."""
        chunks: list[tuple[int, int, list[tuple[int, int, int]]]] = []
        start, pieces = 0, []
        for i, (begin, n) in enumerate(zip(self.starts, self.sizes)):
            end = begin + _padded(n)
            if end - start > limit and pieces:
                chunks.append((start, begin, pieces))
                start, pieces = begin, []
            lo = 0
            while end - start > limit:  # tensor i alone is larger: full chunks of it
                chunks.append((start, start + limit, [(i, lo, lo + limit)]))
                start, lo = start + limit, lo + limit
            if n:
                pieces.append((i, lo, n))
        if pieces:
            chunks.append((start, self.starts[-1], pieces))
        return chunks

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
        self._views: dict[str, list[torch.Tensor]] = {
            k: [self._slice(k, i) for i in range(len(self.masters))] for k in _MOMENTS
        }
        self._views["step"] = [self.buffers["step"][i] for i in range(len(self.masters))]
        # Local views for the compiled step: masters (or remainders) and moments by name.
        kept = "remainder" if self.remainders else "master"
        self.views = {k: [local(v) for v in self._views[k]] for k in _MOMENTS}
        self.views[kept] = [
            self.buffers[kept][s : s + n].view(t.shape)
            for s, n, t in zip(self.starts, self.sizes, self.cast_from)
        ]
        if not self.stale:
            self._install()

    def chunk_views(self, c: int, region: torch.Tensor) -> list[torch.Tensor]:
        """Chunk `c`'s pieces of scratch `region`, cached (Python overhead dominates the step)."""
        key = (c, region.dtype, region.storage_offset())
        if self._views_of.get(key, (None,))[0] != region.data_ptr():
            start, _, pieces = self.chunks[c]
            views = []
            for i, lo, hi in pieces:
                at = self.starts[i] + lo - start
                part = region[at : at + hi - lo]
                whole = lo == 0 and hi == self.sizes[i]
                views.append(part.view(self.cast_from[i].shape) if whole else part)
            self._views_of[key] = (region.data_ptr(), views)
        return self._views_of[key][1]

    def pieces(self, c: int, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Chunk `c`'s pieces of `tensors` (one per group tensor)."""
        out = []
        for i, lo, hi in self.chunks[c][2]:
            whole = lo == 0 and hi == self.sizes[i]
            out.append(tensors[i] if whole else tensors[i].view(-1)[lo:hi])
        return out

    def _slice(self, name: str, i: int) -> torch.Tensor:
        start = self.starts[i]
        return shaped_like(self.buffers[name][start : start + self.sizes[i]], self.masters[i])

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
                value, view = state.get(name), local(views[i])
                if value is None:
                    view.zero_()  # no state yet: torch's start (zero moments, step 0)
                elif not isinstance(value, torch.Tensor):
                    view.fill_(value)  # a step count saved as a number
                elif local(value).data_ptr() != view.data_ptr():
                    view.copy_(local(value))
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
        if group.get("compiled") and all(g is None or g.dtype == self._low_dtype for g in grads):
            self._step_compiled(group, decoupled, factor, grads, found_inf)
        else:
            self._step_chunks(group, decoupled, factor, grads, found_inf)
        if found_inf is not None:
            buf["step"].sub_(found_inf)

    def _step_compiled(
        self,
        group: dict,
        decoupled: bool,
        factor: float,
        grads: list[torch.Tensor | None],
        found_inf: torch.Tensor | None = None,
    ) -> None:
        live = [i for i, g in enumerate(grads) if g is not None]
        taken = [grads[i] for i in live]
        for p in self.model:
            p.grad = None
        grads.clear()
        views = self.views
        pick = lambda name: [views[name][i] for i in live]  # noqa: E731
        beta1, beta2 = group["betas"]
        compiled_adam(
            taken, [local(self.model[i]) for i in live],
            pick("remainder" if self.remainders else "master"), pick("exp_avg"),
            pick("exp_avg_sq"),
            # counts agree (`ready`): a view, where an index would copy and sync
            self.buffers["step"][:1].expand(len(live)), lr=float(group["lr"]), beta1=beta1,
            beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
            maximize=group.get("maximize", False), decoupled_weight_decay=decoupled, factor=factor,
            found_inf=found_inf, remainders=self.remainders,
        )  # fmt: skip

    def _step_chunks(
        self,
        group: dict,
        decoupled: bool,
        factor: float,
        grads: list[torch.Tensor | None],
        found_inf: torch.Tensor | None,
    ) -> None:
        buf = self.buffers
        beta1, beta2 = group["betas"]
        update = torch._fused_adamw_ if decoupled else torch._fused_adam_
        step = [buf["step"][0]]
        device = buf["exp_avg"].device
        low = [local(p) for p in self.model]
        for c, (start, stop, _) in enumerate(self.chunks):
            n = stop - start
            work = scratch(device, n * self.regions)
            into = self.chunk_views(c, work[:n])
            torch._foreach_copy_(into, self.pieces(c, grads))
            for i in self.done[c]:
                grads[i] = None
                self.model[i].grad = None  # cast: drop the low-precision gradient
            if factor != 1.0:
                work[:n].mul_(factor)
            cast_to = self.pieces(c, low)
            if self.remainders:
                master = work[n : 2 * n]
                bits = self.chunk_views(c, master.view(torch.int32))
                torch._foreach_copy_(bits, [t.view(torch.int16) for t in cast_to])
                rem.join(master.view(torch.int32), buf["remainder"][start:stop])
            else:
                master = buf["master"][start:stop]
            moments = [buf["exp_avg"][start:stop], buf["exp_avg_sq"][start:stop]]
            if self.widened:
                at = (1 + self.remainders) * n  # after the gradients (and masters)
                wide = [work[at : at + n], work[at + n : at + 2 * n]]
                torch._foreach_copy_(wide, moments)
                moments, narrow = wide, moments
            update(
                [master], [work[:n]], [moments[0]], [moments[1]], [], step, lr=group["lr"],
                beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                amsgrad=False, maximize=group.get("maximize", False), found_inf=found_inf,
            )  # fmt: skip
            if self.widened:
                torch._foreach_copy_(narrow, moments)
            if self.remainders:
                high = work[:n].view(torch.int32)  # the gradients are spent
                rem.split(master.view(torch.int32), high)
                torch._foreach_copy_(
                    [t.view(torch.int16) for t in cast_to], self.chunk_views(c, high)
                )
                buf["remainder"][start:stop].copy_(master.view(torch.int32))
            else:
                torch._foreach_copy_(cast_to, self.pieces(c, self.cast_from))


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` itself, moved to `device` (`set_` refuses a storage on another device)."""
    if t.device != device:
        t.data = torch.empty(0, dtype=t.dtype, device=device)
    return t
