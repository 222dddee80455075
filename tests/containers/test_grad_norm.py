"""The fp32 precision's global norm and clip (what `step()` does with `max_norm`): parity with
torch in one process, and the global norm under FSDP2."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from components.models.llama.model import FLAVORS, Transformer, split_model
from containers import Precision
from tests.harness.dist import run_ranks


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """The norm and clip of a container step, on `parameters`."""
    params = [p for p in parameters if p.grad is not None]
    norm = Precision().grad_norm(params)
    Precision().clip_(params, norm, max_norm)
    return norm


SHAPES = [(7, 5), (5,), (3, 4, 2), (1,), (11, 3)]


def _params(seed: int = 0, scale: float = 1.0) -> list[nn.Parameter]:
    """Parameters of assorted shapes carrying random gradients."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in SHAPES:
        p = nn.Parameter(torch.randn(shape, generator=g))
        p.grad = scale * torch.randn(shape, generator=g)
        params.append(p)
    return params


def _grads(params) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in params]


def test_matches_torch_clip_grad_norm():
    """Norm and clipped gradients agree with torch's, whether or not clipping bites."""
    for max_norm in (0.5, 3.0, 1e6):
        ours, ref = _params(scale=0.7), _params(scale=0.7)
        norm = clip_grad_norm_(ours, max_norm)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    # The clipping really happened: the gradients now have norm max_norm.
    clipped = _params(scale=0.7)
    clip_grad_norm_(clipped, 0.5)
    assert abs(clip_grad_norm_(clipped, 0).item() - 0.5) < 1e-5


def test_max_norm_zero_only_measures():
    """max_norm = 0 returns the norm and leaves every gradient bitwise as it was."""
    params = _params(seed=1, scale=10.0)
    before = _grads(params)
    norm = clip_grad_norm_(params, 0)
    expected = torch.cat([g.flatten() for g in before]).double().norm()
    assert norm.dim() == 0 and abs(norm.item() - expected.item()) < 1e-4 * expected.item()
    assert norm.item() > 1.0  # so a clip to 0 or to 1 would have shown
    for p, g in zip(params, before):
        assert torch.equal(p.grad, g)


def test_params_without_grad_are_skipped():
    """Parameters whose grad is None neither count nor get a gradient; none at all gives 0."""
    params, ref = _params(seed=2), _params(seed=2)
    for i in (1, 3):
        params[i].grad = None
    with_grad = [p for p in params if p.grad is not None]
    ref = [p for i, p in enumerate(ref) if i not in (1, 3)]
    norm = clip_grad_norm_(params, 1.0)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    assert params[1].grad is None and params[3].grad is None
    for a, b in zip(with_grad, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    empty = [nn.Parameter(torch.ones(3))]
    assert clip_grad_norm_(empty, 1.0).item() == 0.0 and empty[0].grad is None


# -- FSDP2 on 2 gloo ranks --------------------------------------------------------------------


def _loss(parts: list[nn.Module], tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    h = tokens
    for part in parts:
        h = part(h)
    return F.cross_entropy(h.flatten(0, 1), labels.flatten())


def _fsdp_norms() -> dict:
    """Global norm of a 2-part FSDP2 model vs. its unsharded copy, then clip to half."""
    torch.manual_seed(0)
    model = Transformer(FLAVORS["debug"])
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)  # the same batch on every rank
    tokens = torch.randint(0, 256, (2, 32), generator=g)
    labels = torch.randint(0, 256, (2, 32), generator=g)

    _loss([ref], tokens, labels).backward()
    ref_named = dict(ref.named_parameters())
    ref_norm = clip_grad_norm_(ref.parameters(), 0)
    torch_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parts = split_model(model, 2)
    for part in parts:
        for block in part.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(part, mesh=mesh)
    _loss(parts, tokens, labels).backward()
    params = [p for part in parts for p in part.parameters()]
    assert all(isinstance(p.grad, DTensor) for p in params)
    named = {n: p for part in parts for n, p in part.named_parameters()}
    assert named.keys() == ref_named.keys()
    grad_err = max(
        ((named[n].grad.full_tensor() - p.grad).abs().max() / p.grad.abs().max()).item()
        for n, p in ref_named.items()
    )

    norm = clip_grad_norm_(params, 0)
    assert not isinstance(norm, DTensor)
    clipped_to = clip_grad_norm_(params, norm.item() / 2)
    after = clip_grad_norm_(params, 0)
    return {
        "norm": norm,
        "clipped_to": clipped_to,
        "after": after,
        "ref_norm": ref_norm,
        "torch_norm": torch_norm,
        "grad_err": grad_err,
    }


def test_fsdp2_global_norm_matches_unsharded_and_clips_to_half():
    """Sharded norm = single-process norm on every rank; clipping to norm/2 gives norm/2."""
    results = run_ranks(2, _fsdp_norms)
    r0, r1 = results
    torch.testing.assert_close(r0["ref_norm"], r0["torch_norm"], rtol=1e-6, atol=0)
    assert r0["grad_err"] < 1e-4 and r1["grad_err"] < 1e-4
    norm = r0["norm"].item()
    assert norm > 0
    assert abs(norm - r0["ref_norm"].item()) <= 1e-5 * r0["ref_norm"].item()
    for key in ("norm", "clipped_to", "after"):
        assert torch.equal(r0[key], r1[key]), key
    assert torch.equal(r0["clipped_to"], r0["norm"])
    assert abs(r0["after"].item() - norm / 2) <= 1e-5 * norm / 2
