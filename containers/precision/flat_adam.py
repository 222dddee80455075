"""Masters and Adam state of a param group in flat buffers: one fused kernel call per chunk,
or one compiled pass over the group.

Torch's fused Adam/AdamW makes one kernel call per tensor. On a CPU each call costs ~10 us
of dispatch and thread-pool hand-off, so on a transformer's hundreds of tensors that overhead
is a third of the fp32 step, and the mixed-precision step adds two per-tensor passes (the
cast in, the copy back) of its own. Here each eligible param group (`eligible`) keeps its fp32
masters, `exp_avg`, `exp_avg_sq` and step counts in flat buffers. The masters are rebound onto
them (`Tensor.set_`, so every holder of a master still holds it) and the optimizer state
entries are views, so `state_dict`, DCP templates, loads and torch's own `step` see torch's
layout. A step casts the low-precision gradients into the fp32 scratch buffer a chunk at a
time, multiplies the chunk (unscale x clip), and runs one `torch._fused_adam(w)_` call on the
chunk's flat slices. With `[mixed_precision] compile = true` the group steps instead as one
inductor graph over its flat buffers (`_adam`): the low-precision gradients gathered into a
flat buffer of their dtype (2 bytes/param more, kept), read once, and the new parameters written
into it and scattered back; a few fp32 ulp from the eager kernel (another order of roundings).

Every tensor starts on a `PAD`-element boundary and chunks cut at such boundaries, so the
kernel runs every element on its vector path whatever the chunking (a tensor's last few
elements otherwise take a scalar tail, which can round differently in the last place): the
result does not depend on how params are grouped into units, chunks or optimizers, and equals
torch's per-tensor fused step bitwise for tensors whose size is a multiple of `PAD`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch.optim import Optimizer

from containers.norm import SCRATCH_NUMEL, local, scratch, shaped_like

__all__ = ["PAD", "FlatGroup", "eligible"]

PAD = 64
"""Elements each tensor's slice is rounded up to: a multiple of every CPU vector width and of
the fused kernel's per-thread split (one 64-byte cache line)."""

_MOMENTS = ("exp_avg", "exp_avg_sq")


def eligible(opt: Optimizer, group: dict) -> bool:
    """Whether `group` of `opt` can step flat: torch's own Adam or AdamW with the fused
    kernel chosen, whose update of an element reads only that element's gradient and state."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW) or not group["params"]:
        return False
    if not group.get("fused") or group.get("amsgrad") or group.get("differentiable"):
        return False
    tensors = [local(m) for m in group["params"]]
    return all(t.is_contiguous() for t in tensors) and len({t.device for t in tensors}) == 1


def _position(opt: Optimizer, group: dict) -> int:
    return next(i for i, g in enumerate(opt.param_groups) if g is group)


def _padded(n: int) -> int:
    return -(-n // PAD) * PAD


class FlatGroup:
    """One param group's masters and Adam state as views of flat buffers.

    Args:
        opt: the inner optimizer (`eligible` for `group`).
        group: one of its param groups; its params are the masters.
        model: the model parameter of each master, in the group's order.
        chunk_numel: elements cast and stepped per kernel call (rounded down to `PAD`).
    """

    def __init__(
        self,
        opt: Optimizer,
        group: dict,
        model: Sequence[torch.Tensor],
        chunk_numel: int = SCRATCH_NUMEL,
    ) -> None:
        with torch.no_grad():
            self._build(opt, group, model, chunk_numel)

    def _build(
        self, opt: Optimizer, group: dict, model: Sequence[torch.Tensor], chunk_numel: int
    ) -> None:
        # By position: torch's load_state_dict replaces the group dicts (an LR scheduler
        # then sets lr in the new ones).
        self.opt, self.index, self.model = opt, _position(opt, group), list(model)
        self.masters: list[torch.Tensor] = list(group["params"])
        pieces = [local(m) for m in self.masters]
        self.sizes = [t.numel() for t in pieces]
        self.starts = [0]
        for n in self.sizes:
            self.starts.append(self.starts[-1] + _padded(n))
        total, first = self.starts[-1], pieces[0]
        self.buffers = {
            "master": torch.zeros(total, dtype=first.dtype, device=first.device),
            **{k: torch.zeros(total, dtype=first.dtype, device=first.device) for k in _MOMENTS},
            # fused kernels want float32 step counts on the parameters' device
            "step": torch.zeros(len(pieces), dtype=torch.float32, device=first.device),
        }
        for piece, start, n in zip(pieces, self.starts, self.sizes):
            self.buffers["master"][start : start + n].copy_(piece.view(-1))
        self.live = list(zip(self.model, self.sizes))
        self._low_dtype = local(self.model[0]).dtype
        self._empty = [p for p, n in self.live if not n]
        self._low: torch.Tensor | None = None  # the compiled step's gradient/parameter buffer
        self.chunk(chunk_numel)
        # Stale: the optimizer state holds values that are not in the buffers (torch's start,
        # a load, torch's own step having made new tensors), to take at the next use.
        self.stale = True
        self.uniform: bool | None = None  # all step counts equal; None: not known
        self._rebind()
        self.adopt()  # state views from the start: DCP loads into them in place

    def chunk(self, numel: int) -> None:
        """Step in chunks of at most `numel` elements (rounded down to `PAD`)."""
        self.chunks = self._plan(max(PAD, numel // PAD * PAD))
        # per chunk: the tensors whose last piece it holds; its views (see `_chunk_views`)
        self._done = [[i for i, _, hi in c[2] if hi == self.sizes[i]] for c in self.chunks]
        self._views_of: dict[int, tuple] = {}

    def _plan(self, limit: int) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
        """Chunks (start, stop, pieces) of at most `limit` elements of the flat buffers, cut
        between tensors where they fit; a piece (i, lo, hi) is elements lo:hi of tensor i (a
        tensor larger than a chunk spans several)."""
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
        """Point every master at its slice of the master buffer and every state entry at
        its slices (after the buffers were made or moved); values are not touched."""
        master = self.buffers["master"]
        for i, m in enumerate(self.masters):
            piece = local(m)
            piece.set_(master.untyped_storage(), self.starts[i], piece.shape, piece.stride())
        self._cast_from = [local(m) for m in self.masters]
        self._views: dict[str, list[torch.Tensor]] = {
            k: [self._slice(k, i) for i in range(len(self.masters))] for k in _MOMENTS
        }
        self._views["step"] = [self.buffers["step"][i] for i in range(len(self.masters))]
        if not self.stale:
            self._install()

    def _chunk_views(
        self, c: int, work: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Chunk `c`'s pieces of the scratch buffer `work` and of the masters, kept while
        `work` and the buffers stay where they are (the step's Python is most of its cost)."""
        key = (work.data_ptr(), self.buffers["master"].data_ptr())
        if self._views_of.get(c, (None,))[0] != key:
            start, _, pieces = self.chunks[c]
            into, cast_from = [], []
            for i, lo, hi in pieces:
                at = self.starts[i] + lo - start
                part = work[at : at + hi - lo]
                whole = lo == 0 and hi == self.sizes[i]
                master = self._cast_from[i]
                into.append(part.view(master.shape) if whole else part)
                cast_from.append(master if whole else master.view(-1)[lo:hi])
            self._views_of[c] = (key, into, cast_from)
        return self._views_of[c][1], self._views_of[c][2]

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
        """Take the values the optimizer state holds now (torch's start, a load, torch's own
        step) into the buffers and make the state views of them again."""
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

    def move(self, device: torch.device, moved) -> None:
        """Move the buffers to `device` with `moved(tensor, device)` and rebind onto them."""
        if self.stale:
            self.adopt()
        self.buffers = {k: moved(v, device) for k, v in self.buffers.items()}
        self._rebind()

    def ready(self) -> bool:
        """Whether this step can be flat: every tensor has a gradient and all step counts
        agree. If not (a parameter without a gradient, a load of uneven counts), torch's own
        step runs on the same views, and the counts are checked again next time."""
        if self.stale:
            self.adopt()
        if self.uniform is None:
            steps = self.buffers["step"]
            self.uniform = bool(steps.eq(steps[0]).all())
        # (An empty shard, e.g. an FSDP1 slice elsewhere, may get no gradient: nothing to do.)
        if self.uniform and all(p.grad is not None for p, n in self.live if n):
            return True
        self.uniform = None
        return False

    @torch.no_grad()
    def step(
        self,
        factor: float,
        compiled: bool = False,
        sums: dict[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Cast, multiply by `factor`, step and write back the masters, chunk by chunk, or
        all in one inductor pass if `compiled` (and the gradients are low precision); drop
        each low-precision gradient once it is cast. `sums`: parameter -> its fp32 gradient
        sum (`containers.precision.sums`), stepped on instead of its gradient (and taken out)."""
        group, buf = self.opt.param_groups[self.index], self.buffers
        decoupled = group.get("decoupled_weight_decay", type(self.opt) is torch.optim.AdamW)
        beta1, beta2 = group["betas"]
        buf["step"].add_(1)
        grads = [_gradient(p, sums) if n else None for p, n in self.live]
        for p in self._empty:
            p.grad = None  # empty: stepped with the rest (its count stays even)
        if compiled and all(g is None or g.dtype == self._low_dtype for g in grads):
            self._step_compiled(group, decoupled, factor, grads)
            return
        update = torch._fused_adamw_ if decoupled else torch._fused_adam_
        step = [buf["step"][0]]
        device = buf["master"].device
        for c, (start, stop, pieces) in enumerate(self.chunks):
            work = scratch(device, stop - start)
            into, cast_from = self._chunk_views(c, work)
            src, cast_to = [], []
            for i, lo, hi in pieces:
                if lo == 0 and hi == self.sizes[i]:
                    src.append(grads[i])
                    cast_to.append(local(self.model[i]))
                else:
                    src.append(grads[i].view(-1)[lo:hi])
                    cast_to.append(local(self.model[i]).view(-1)[lo:hi])
            torch._foreach_copy_(into, src)
            del src
            for i in self._done[c]:
                grads[i] = None
                self.model[i].grad = None  # cast: the low-precision gradient can go now
            if factor != 1.0:
                work.mul_(factor)
            update(
                [buf["master"][start:stop]], [work], [buf["exp_avg"][start:stop]],
                [buf["exp_avg_sq"][start:stop]], [], step, lr=group["lr"], beta1=beta1,
                beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                amsgrad=False, maximize=group.get("maximize", False),
            )  # fmt: skip
            torch._foreach_copy_(cast_to, cast_from)

    def _step_compiled(
        self, group: dict, decoupled: bool, factor: float, grads: list[torch.Tensor | None]
    ) -> None:
        """The step as one inductor graph over the flat buffers: the gradients gathered into
        a flat low-precision buffer (one foreach copy), read once, and the new parameters
        written into the same buffer, then scattered to the model (one foreach copy)."""
        buf = self.buffers
        if self._low is None or self._low.device != buf["master"].device:
            self._low = torch.zeros_like(buf["master"], dtype=self._low_dtype)
            self._low_views = [self._low[s : s + n] for s, n in zip(self.starts, self.sizes)]
        live = [i for i, g in enumerate(grads) if g is not None]
        torch._foreach_copy_([self._low_views[i] for i in live], [grads[i].view(-1) for i in live])
        for p in self.model:
            p.grad = None
        grads.clear()
        step = buf["step"][0].item()
        lr, wd = float(group["lr"]), group["weight_decay"]
        beta1, beta2 = group["betas"]
        hyper = torch.tensor(
            [
                factor * (-1.0 if group.get("maximize", False) else 1.0),
                1.0 - lr * wd if decoupled else 1.0,  # decoupled decay: a multiply
                0.0 if decoupled else wd,  # coupled decay: added to the gradient
                1.0 - beta1,
                beta2,
                1.0 - beta2,
                lr / (1.0 - beta1**step),
                math.sqrt(1.0 - beta2**step),
                group["eps"],
            ],
            dtype=torch.float32,
            device=buf["master"].device,
        )
        _compiled_adam()(buf["master"], buf["exp_avg"], buf["exp_avg_sq"], self._low, hyper)
        out = [local(p).view(-1) for p in self.model]
        torch._foreach_copy_([out[i] for i in live], [self._low_views[i] for i in live])


def _adam(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    low: torch.Tensor,
    h: torch.Tensor,
) -> None:
    """Adam/AdamW over flat buffers in one pass: `low` holds the low-precision gradients on
    the way in and the new low-precision parameters on the way out; `h` the hyperparameters
    (`FlatGroup._step_compiled`), a tensor so that no value recompiles. torch's fused kernel's
    operations, though not its order of roundings: a few fp32 ulp apart from it."""
    grad = low.float() * h[0] + master * h[2]
    avg = exp_avg.lerp(grad, h[3])
    avg_sq = exp_avg_sq * h[4] + grad * grad * h[5]
    new = master * h[1] - h[6] * avg / (avg_sq.sqrt() / h[7] + h[8])
    exp_avg.copy_(avg)
    exp_avg_sq.copy_(avg_sq)
    master.copy_(new)
    low.copy_(new)


@functools.cache
def _compiled_adam() -> Callable[..., None]:
    """`_adam` compiled on first use (tens of seconds once, then inductor's cache): one graph
    for every group, whatever its size."""
    return torch.compile(_adam, dynamic=True, fullgraph=True)


def _gradient(p: torch.Tensor, sums: dict[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """What `p`'s master steps on: its fp32 sum if one is kept, else its gradient."""
    total = sums.pop(p, None) if sums is not None else None
    return total if total is not None else local(p.grad)
