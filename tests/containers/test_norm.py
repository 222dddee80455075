"""The global norm and clip (what `step()` does with `max_norm`): parity with torch in one
process, and each gradient element counted once under FSDP2, PP x FSDP2, TP x FSDP2 and HSDP;
the finite checks a step without a clip takes instead."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from components.models.llama.model import (
    FLAVORS,
    FeedForward,
    ModelArgs,
    Transformer,
    split_model,
)
from containers import (
    MasterWeights,
    MixedPrecisionOptimizersContainer,
    OptimizersContainer,
    Precision,
    norm,
)
from containers.norm import GlobalNorm, all_finite, clip_grads, nonfinite_flag
from tests.harness.dist import run_ranks


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """The norm and clip of a container step, on `parameters`."""
    params = [p for p in parameters if p.grad is not None]
    norm = Precision().grad_norm(params)
    clip_grads(params, norm, max_norm)
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


# -- FSDP2 (no mesh given), PP x FSDP2, TP x FSDP2, HSDP on 4 gloo ranks: one launch ---------


def _loss(parts: list[nn.Module], tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    h = tokens
    for part in parts:
        h = part(h)
    return F.cross_entropy(h.flatten(0, 1), labels.flatten())


def _fsdp_norms() -> dict:
    """Global norm of a 2-part FSDP2 model vs. its unsharded copy, then clip to half."""
    torch.manual_seed(0)
    model = Transformer(FLAVORS["tiny"])
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)  # the same batch on every rank
    tokens = torch.randint(0, 256, (2, 16), generator=g)
    labels = torch.randint(0, 256, (2, 16), generator=g)

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


DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def _precision(kind: str) -> Precision:
    return MasterWeights() if kind == "bf16" else Precision()


def _cast(precision: Precision, model: nn.Module) -> nn.Module:
    """`model` with the parameter dtype `precision` steps (bf16 for `MasterWeights`)."""
    return precision.cast_model(model) if isinstance(precision, MasterWeights) else model


def _llama_loss(parts: list[nn.Module]) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)  # the same batch on every rank
    tokens = torch.randint(0, 256, (2, 16), generator=g)
    # x 20: a norm well above 1, so torch's 1e-6 in the clip coefficient stays below rel 1e-6.
    return 20 * _loss(parts, tokens, tokens.roll(-1, 1))


def _norm64(grads) -> float:
    """The single-process norm of full (unsharded) gradients, in fp64."""
    return torch.stack([g.double().norm() for g in grads]).norm().item()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _measure(parts, mesh, precision, ref_norm: float, **refs: float) -> dict:
    """Step a container (SGD, lr 1, clip to half the reference norm) from zeroed weights, so
    that the weights become minus the clipped gradients; measure them with the same rule."""
    grads_norm = _norm64(_full(p.grad) for part in parts for p in part.parameters())
    cls = MixedPrecisionOptimizersContainer if isinstance(precision, MasterWeights) else None
    container = (cls or OptimizersContainer)(
        parts, torch.optim.SGD, {"lr": 1.0}, precision=precision, max_norm=ref_norm / 2, mesh=mesh
    )
    stepped = [p for opt in container for g in opt.param_groups for p in g["params"]]
    with torch.no_grad():
        for s in stepped:
            _local(s).zero_()
    container.step()
    after = container.global_norm(stepped).item()
    with torch.no_grad():
        # A NaN on one rank only (another stage under PP) makes the norm NaN on every rank.
        if dist.get_rank() == dist.get_world_size() - 1:
            _local(stepped[0]).view(-1)[0] = float("nan")
    nonfinite = container.global_norm(stepped).item()
    return {
        "norm": container.last_report.grad_norm,
        "ref": ref_norm,
        "grads_ref": grads_norm,
        "after": after,
        "max_norm": ref_norm / 2,
        "nonfinite": nonfinite,
        **refs,
    }


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _pp_fsdp(mesh, kind: str) -> dict:
    """PP2 x FSDP2: each pp rank keeps its stage, sharded over dp_shard; its gradients are the
    full model's (one forward/backward on every rank), sharded as the parameters are."""
    precision = _precision(kind)
    torch.manual_seed(0)
    model = _cast(precision, Transformer(FLAVORS["tiny"]))
    ref = copy.deepcopy(model)
    _llama_loss([ref]).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    stage = split_model(model, 2)[mesh["pp"].get_local_rank()]
    for block in stage.layers.values():
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(stage, mesh=mesh["dp_shard"])
    for n, p in stage.named_parameters():
        p.grad = distribute_tensor(ref_grads[n], p.device_mesh, p.placements, src_data_rank=None)
    result = _measure([stage], mesh, precision, _norm64(ref_grads.values()))
    # Only this stage's gradients: what a per-stage (pp-blind) norm would give.
    result["grads_ref"] = result["ref"]
    result["stage"] = _norm64(ref_grads[n] for n, _ in stage.named_parameters())
    return result


class _NormMLP(nn.Module):
    """RMSNorm (left out of TP: FSDP-only, replicated over tp) then a SwiGLU MLP (TP)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(16)
        self.ff = FeedForward(ModelArgs(dim=16, ffn_hidden=48))
        nn.init.normal_(self.norm.weight, 1.0, 0.5)  # a gradient of its own weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(self.norm(x))


def _tp_fsdp(mesh, kind: str) -> dict:
    """TP2 x FSDP2, a real forward/backward on the same batch everywhere."""
    precision = _precision(kind)
    torch.manual_seed(0)
    model = _cast(precision, _NormMLP())
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1)).to(model.norm.weight)
    ref(x).float().square().sum().backward()
    plan = {"ff.w1": ColwiseParallel(), "ff.w3": ColwiseParallel(), "ff.w2": RowwiseParallel()}
    parallelize_module(model, mesh["tp"], plan)
    fully_shard(model, mesh=mesh["dp_shard"])
    model(x).float().square().sum().backward()
    placements = {n: tuple(p.grad.placements) for n, p in model.named_parameters()}
    assert placements["norm.weight"] == (Shard(0),), placements  # FSDP-only, copied over tp
    assert len(placements["ff.w2.weight"]) == 2, placements  # dp_shard x tp
    ref_norm = _norm64(p.grad for p in ref.parameters())
    return _measure([model], mesh, precision, ref_norm)


def _hsdp(mesh, kind: str) -> dict:
    """HSDP 2 x 2 (Replicate, Shard(0)), a real forward/backward on the same batch everywhere."""
    precision = _precision(kind)
    torch.manual_seed(0)
    model = _cast(precision, Transformer(FLAVORS["tiny"]))
    ref = copy.deepcopy(model)
    _llama_loss([ref]).backward()
    dp = mesh["dp_replicate", "dp_shard"]
    for block in model.layers.values():
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    _llama_loss([model]).backward()
    return _measure([model], mesh, precision, _norm64(p.grad for p in ref.parameters()))


def _mesh_cases() -> dict:
    meshes = {
        "pp_fsdp": init_device_mesh("cpu", (2, 1, 2, 1), mesh_dim_names=DIMS),
        "tp_fsdp": init_device_mesh("cpu", (1, 1, 2, 2), mesh_dim_names=DIMS),
        "hsdp": init_device_mesh("cpu", (1, 2, 2, 1), mesh_dim_names=DIMS),
    }
    build = {"pp_fsdp": _pp_fsdp, "tp_fsdp": _tp_fsdp, "hsdp": _hsdp}
    out: dict = {"fsdp": _fsdp_norms()}  # 1-D FSDP2, no mesh given: one stage over the world
    for case, fn in build.items():
        for kind in ("fp32", "bf16"):
            out[case, kind] = fn(meshes[case], kind)
    out["wrong_mesh"] = ""
    try:  # a mesh that is not the job's (over fewer ranks than the world)
        GlobalNorm([], meshes["hsdp"]["dp_shard"])
    except ValueError as e:
        out["wrong_mesh"] = str(e)
    return out


@pytest.fixture(scope="module")
def mesh_cases() -> list[dict]:
    return run_ranks(4, _mesh_cases)


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
@pytest.mark.parametrize("case", ["pp_fsdp", "tp_fsdp", "hsdp"])
def test_global_norm_over_the_job_mesh_counts_each_element_once_and_clips(mesh_cases, case, kind):
    """PP2 x FSDP2, TP2 x FSDP2 and HSDP 2x2 on 4 ranks, for the fp32 and the mixed-precision
    container: the norm equals the single-process norm of the same gradients (rel 1e-5) on
    every rank, and after the clip to half of it the gradients' global norm is max_norm."""
    results = [r[case, kind] for r in mesh_cases]
    r = results[0]
    assert all(x["norm"] == r["norm"] for x in results), [x["norm"] for x in results]
    assert r["norm"] > 1.0  # the clip's 1e-6 stays negligible
    assert _close(r["norm"], r["grads_ref"], 1e-5), r
    # The unsharded model's own norm: the gradients themselves are right too (bf16 sums in
    # another order under TP and sharding).
    assert _close(r["norm"], r["ref"], 1e-5 if kind == "fp32" else 2e-2), r
    for x in results:
        assert _close(x["after"], x["max_norm"], 1e-5), x
        assert math.isnan(x["nonfinite"]), x
    if case == "pp_fsdp":  # each pp rank alone sees less: the stages were summed
        assert r["stage"] < 0.99 * r["ref"] and results[-1]["stage"] < 0.99 * r["ref"]


def test_fsdp2_global_norm_matches_unsharded_and_clips_to_half(mesh_cases):
    """Sharded norm = single-process norm on every rank; clipping to norm/2 gives norm/2."""
    results = [r["fsdp"] for r in mesh_cases]
    r0 = results[0]
    torch.testing.assert_close(r0["ref_norm"], r0["torch_norm"], rtol=1e-6, atol=0)
    assert all(r["grad_err"] < 1e-4 for r in results)
    norm = r0["norm"].item()
    assert norm > 0
    assert abs(norm - r0["ref_norm"].item()) <= 1e-5 * r0["ref_norm"].item()
    for key in ("norm", "clipped_to", "after"):
        assert all(torch.equal(r0[key], r[key]) for r in results), key
    assert torch.equal(r0["clipped_to"], r0["norm"])
    assert abs(r0["after"].item() - norm / 2) <= 1e-5 * norm / 2


def test_a_mesh_over_fewer_ranks_than_the_world_is_refused(mesh_cases):
    assert all("holds 2 ranks but the world has 4" in r["wrong_mesh"] for r in mesh_cases)


# -- the finite checks ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_is_exact_where_a_sum_would_overflow_and_leaves_tensors_bitwise(dtype):
    big = torch.finfo(dtype).max
    tensors = [torch.full((1000,), big, dtype=dtype), torch.tensor([-0.0, 1e-8], dtype=dtype)]
    before = [t.clone() for t in tensors]
    assert all_finite(tensors)
    for t, b in zip(tensors, before):
        assert torch.equal(t, b) and t.signbit().equal(b.signbit())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_bad_element_in_a_mixed_dtype_list_is_found(bad):
    tensors = [torch.ones(3), torch.ones(5, dtype=torch.bfloat16), torch.zeros(0)]
    tensors[1][4] = bad
    assert not all_finite(tensors)
    assert all_finite(tensors[:1] + tensors[2:])


def test_sparse_gradients_are_checked_by_their_values():
    good = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,), check_invariants=True)
    bad = torch.sparse_coo_tensor([[1]], [float("nan")], (4,), check_invariants=True)
    assert all_finite([good]) and not all_finite([good, bad]) and all_finite([])


@pytest.mark.parametrize(
    ("on_host", "device"),
    [
        (True, "cpu"),
        (False, "cpu"),
        pytest.param(
            False,
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="on a GPU only"),
        ),
    ],
    ids=["host", "device_kernel", "cuda"],
)
def test_the_flag_for_fused_kernels_finds_what_all_finite_finds_and_leaves_tensors_bitwise(
    on_host, device
):
    """`nonfinite_flag` as a step takes it on CUDA (`on_host=False`: torch's AMP check, and
    bf16 by its fp64 squares, which CUDA's AMP check refuses; run here on CPU tensors too)
    and elsewhere: the same answers, values and signs kept."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    for bad, want in ((float("nan"), 1.0), (float("inf"), 1.0), (float("-inf"), 1.0)):
        for where, dtype in enumerate(dtypes):
            tensors = [torch.randn(300, dtype=d, device=device) for d in dtypes]
            tensors.append(torch.zeros(0, device=device))
            tensors[where][7 * where] = bad
            assert nonfinite_flag(tensors, [], on_host=on_host).item() == want, (bad, dtype)
    big = [torch.full((1000,), torch.finfo(d).max, dtype=d, device=device) for d in dtypes]
    big.append(torch.tensor([-0.0, 1e-8], device=device))
    before = [t.clone() for t in big]
    flag = nonfinite_flag(big, [], on_host=on_host)
    assert flag.item() == 0.0 and flag.dtype == torch.float32 and flag.dim() == 0
    for t, b in zip(big, before):
        assert torch.equal(t, b) and t.signbit().equal(b.signbit())


def _flag_on_ranks(on_host: bool) -> float:
    grads = [torch.randn(64), torch.randn(32)]
    if dist.get_rank() == 1:
        grads[1][3] = float("nan")
    return nonfinite_flag(grads, [None], on_host=on_host).item()


@pytest.mark.parametrize("on_host", [True, False], ids=["host", "device_kernel"])
def test_the_flag_is_the_worlds(on_host):
    assert run_ranks(2, _flag_on_ranks, on_host) == [1.0, 1.0]


def test_low_precision_gradients_larger_than_the_scratch_buffer_go_through_it(monkeypatch):
    """A gradient larger than the kept buffer is measured in pieces of it: a buffer of its own
    size would be a new allocation every step (page-faulted in: half a CPU step)."""
    kept = norm.scratch_numel(torch.device("cpu"))
    asked: list[int] = []
    scratch = norm.scratch

    def recording(device: torch.device, numel: int) -> torch.Tensor:
        asked.append(numel)
        return scratch(device, numel)

    monkeypatch.setattr(norm, "scratch", recording)
    torch.manual_seed(0)
    grads = [torch.randn(2 * kept + 5).bfloat16(), torch.randn(3, 7).bfloat16()]
    total = norm.sum_of_squares(grads, torch.device("cpu"))
    assert asked and max(asked) <= kept
    exact = sum(g.double().square().sum() for g in grads)
    assert torch.isclose(total.double(), exact, rtol=1e-4)  # (fp32 sums of 2M squares)
