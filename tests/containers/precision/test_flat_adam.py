"""containers/flat_adam.py: flat buffers step as torch's fused Adam(W), keep torch's layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from containers import LeanAdam, LeanAdamW, MixedPrecisionOptimizersContainer
from containers import MixedPrecisionSettings as MP
from containers.precision.flat_adam import PAD
from tests.harness.helpers import lean_compiled

FACTOR = 0.3  # unscale x clip: not a power of two, so a different rounding would show
ALIGNED = [(4, PAD), (3 * PAD,), (PAD, 5), (2, 2, PAD)]  # sizes torch's kernel runs all-vector
ODD = [(5, 3), (7,), (2, 2, 2), (11,), (1,), (4, 67)]


def _model(shapes, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Module()
    for i, s in enumerate(shapes):
        m.register_parameter(f"w{i}", nn.Parameter(torch.randn(s).to(torch.bfloat16)))
    return m


def _container(model, cls=torch.optim.AdamW, chunk_numel: int | None = None, **kw):
    kwargs = {"lr": 1e-2, "weight_decay": 0.1, "fused": True, **kw}
    mp = MixedPrecisionOptimizersContainer([model], cls, kwargs, settings=MP(loss_scaling="none"))
    if chunk_numel is not None:  # rebuilt with small chunks, so tensors span several
        flats = mp.precision._flat[id(mp.optimizers[0])]
        for f in flats:
            f.chunk(chunk_numel)
    return mp


def _grads(shapes, step: int) -> list[torch.Tensor]:
    torch.manual_seed(100 + step)
    return [torch.randn(s).to(torch.bfloat16) for s in shapes]


def _step(mp, model, grads, factor: float = 1.0) -> None:
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    mp.precision.unscale = factor  # as a loss scale of 1 / factor would
    mp.precision.apply(mp.optimizers)


@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        (torch.optim.AdamW, {}),
        (torch.optim.Adam, {}),
        # bf16 moment buffers, widened per chunk and rounded back: the lean class's step
        (LeanAdamW, {"moment_dtype": "bfloat16"}),
        (LeanAdam, {"moment_dtype": "bfloat16"}),
    ],
)
def test_flat_steps_equal_torch_fused_per_tensor_bitwise_across_chunks(cls, kw):
    model = _model(ALIGNED)
    mp = _container(model, cls, chunk_numel=2 * PAD, **kw)
    (flat,) = mp.precision._flat[id(mp.optimizers[0])]
    assert flat.budget < 3 * PAD  # the (3 * PAD,) tensor steps in pieces
    assert flat.moments["exp_avg"][0].dtype == getattr(torch, kw.get("moment_dtype", "float32"))
    masters = [nn.Parameter(p.detach().float()) for p in _model(ALIGNED).parameters()]
    ref = cls(masters, lr=1e-2, weight_decay=0.1, fused=True, **kw)
    for step in range(3):
        grads = _grads(ALIGNED, step)
        _step(mp, model, grads, FACTOR)
        for m, g in zip(masters, grads):
            m.grad = g.float() * FACTOR
        ref.step()
        assert all(p.grad is None for p in model.parameters())  # dropped once cast
    state = mp.state_dict()
    for i, (p, m) in enumerate(zip(model.parameters(), masters)):
        assert torch.equal(p, m.detach().bfloat16()), i
        assert torch.equal(state[f"master_weights.w{i}"], m.detach()), i
        for name, value in ref.state[m].items():
            assert state[f"state.w{i}.{name}"].dtype == value.dtype, (i, name)
            assert torch.equal(state[f"state.w{i}.{name}"], value), (i, name)


def test_odd_sizes_do_not_depend_on_chunking_and_stay_within_an_ulp_of_torch():
    runs = []
    for chunk in (PAD, 1 << 20):
        model = _model(ODD)
        mp = _container(model, chunk_numel=chunk)
        for step in range(3):
            _step(mp, model, _grads(ODD, step), FACTOR)
        runs.append(mp.state_dict())
    masters = [nn.Parameter(p.detach().float()) for p in _model(ODD).parameters()]
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(3):
        for m, g in zip(masters, _grads(ODD, step)):
            m.grad = g.float() * FACTOR
        ref.step()
    for key, value in runs[0].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(runs[1][key], value), key
    for i, m in enumerate(masters):
        torch.testing.assert_close(runs[0][f"master_weights.w{i}"], m.detach(), rtol=1e-6, atol=0)


def test_state_is_torch_layout_as_views_and_a_load_lands_in_the_buffers():
    model = _model(ALIGNED)
    mp = _container(model)
    opt = mp.optimizers[0]
    (flat,) = mp.precision._flat[id(opt)]
    kept = [m.untyped_storage() for m in flat.moments["exp_avg"]]
    for step in range(2):
        _step(mp, model, _grads(ALIGNED, step))
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in mp.state_dict().items()}
    # A second run from the saved state continues exactly as the first.
    other_model = _model(ALIGNED, seed=1)
    other = _container(other_model)
    other.load_state_dict(saved)
    for container in (mp, other):  # as an LR scheduler would, in the groups a load made
        container.param_groups[0]["lr"] = 5e-3
    for step in (2, 3):
        _step(mp, model, _grads(ALIGNED, step))
        _step(other, other_model, _grads(ALIGNED, step))
    for (key, a), b in zip(mp.state_dict().items(), other.state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), key
    # Torch's own layout, held where the group keeps it: no step or load made another.
    assert [opt.state[m]["exp_avg"].untyped_storage() for m in flat.masters] == kept
    (other_flat,) = other.precision._flat[id(other.optimizers[0])]
    other_storage = other_flat.buffers["master"].untyped_storage()
    assert all(m.untyped_storage() is other_storage for m in other_flat.masters)


def test_a_parameter_without_a_gradient_takes_torchs_step_and_counts_stay_right():
    model = _model(ALIGNED)
    mp = _container(model)
    masters = [nn.Parameter(p.detach().float()) for p in _model(ALIGNED).parameters()]
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, fused=True)
    (flat,) = mp.precision._flat[id(mp.optimizers[0])]
    for step in range(4):
        grads = _grads(ALIGNED, step)
        if step == 1:
            grads[2] = None  # unused this step: its count stays behind
        for p, g in zip(model.parameters(), grads):
            p.grad = None if g is None else g.clone()
        mp.precision.apply(mp.optimizers)
        for m, g in zip(masters, grads):
            m.grad = None if g is None else g.float()
        ref.step()
    assert not flat.uniform  # uneven counts: every later step is torch's, still exact
    state = mp.state_dict()
    for i, m in enumerate(masters):
        for name, value in ref.state[m].items():
            assert torch.equal(state[f"state.w{i}.{name}"], value), (i, name)
    assert state["state.w2.step"].item() == 3 and state["state.w0.step"].item() == 4


def test_only_fused_adam_groups_go_flat():
    model = _model(ALIGNED)
    assert len(_container(model).precision._flat) == 1
    foreach = _container(model, fused=False)
    amsgrad = _container(model, amsgrad=True)
    sgd = MixedPrecisionOptimizersContainer([model], torch.optim.SGD, {"lr": 0.1})
    assert not foreach.precision._flat and not amsgrad.precision._flat and not sgd.precision._flat


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled_keeps_fused_on_sums"])
def test_fp32_gradient_sums_step_flat_as_torch_fused_on_the_sums(compile):
    """grad_accumulation_dtype "float32": the flat groups step on the fp32 sums of the
    micro-batches' bf16 gradients (no per-tensor step), bitwise torch's fused AdamW on them."""
    model = _model(ALIGNED)
    settings = MP(loss_scaling="none", grad_accumulation_dtype="float32")
    kwargs = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}
    built = lean_compiled(torch.optim.AdamW, kwargs, compile)
    mp = MixedPrecisionOptimizersContainer([model], *built, settings=settings)
    masters = [nn.Parameter(p.detach().float()) for p in _model(ALIGNED).parameters()]
    ref = torch.optim.AdamW(masters, **kwargs)
    calls = []
    mp.optimizers[0].register_step_pre_hook(lambda *a: calls.append(1))  # torch's own step
    for step in range(3):
        mp.zero_grad()
        sums = [torch.zeros(p.shape) for p in masters]
        for k in range(3):  # micro-batches: d loss / d p = c, a bf16 tensor
            cs = _grads(ALIGNED, 10 * step + k)
            sum(((p.float() * c.float()).sum() for p, c in zip(model.parameters(), cs))).backward()
            for total, c in zip(sums, cs):
                total.add_(c.float())
        mp.step()
        for m, total in zip(masters, sums):
            m.grad = total
        ref.step()
    assert not calls
    for p, m in zip(model.parameters(), masters):
        assert torch.equal(p, m.detach().bfloat16())
    state = mp.state_dict()
    for i, m in enumerate(masters):
        assert torch.equal(state[f"master_weights.w{i}"], m.detach()), i
        assert torch.equal(state[f"state.w{i}.exp_avg_sq"], ref.state[m]["exp_avg_sq"]), i


def test_bf16_moments_load_into_the_flat_buffers_in_their_dtype_and_resume_bitwise():
    model = _model(ALIGNED)
    mp = _container(model, LeanAdamW, moment_dtype="bfloat16")
    for step in range(2):
        _step(mp, model, _grads(ALIGNED, step))
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in mp.state_dict().items()}
    other_model = _model(ALIGNED, seed=1)
    other = _container(other_model, LeanAdamW, moment_dtype="bfloat16")
    (flat,) = other.precision._flat[id(other.optimizers[0])]
    template = other.state_dict()  # DCP loads into these views in place
    assert template["state.w0.exp_avg"] is flat.moments["exp_avg"][0]
    other.load_state_dict(saved)
    for step in (2, 3):
        _step(mp, model, _grads(ALIGNED, step))
        _step(other, other_model, _grads(ALIGNED, step))
    got = other.state_dict()
    for key, a in mp.state_dict().items():
        if isinstance(a, torch.Tensor):
            assert a.dtype == got[key].dtype and torch.equal(a, got[key]), key


# Rows of whole blocks, a row cut inside its last block, a 3-D stack, a vector (bf16 moments).
CODED = [(8, 2 * PAD), (3, 40), (2, 3, PAD), (PAD,)]


@pytest.mark.parametrize(
    ("param_dtype", "remainders"),
    [("bfloat16", False), ("bfloat16", True), ("float16", False)],
    ids=["bf16", "bf16_remainders", "fp16"],
)
def test_8bit_moments_under_masters_step_as_the_8bit_step_of_the_masters_bitwise(
    param_dtype, remainders
):
    """8-bit moments compose with every master codec: the masters and codes are the 8-bit
    step of plain fp32 parameters fed the same unscaled gradients, bit for bit; a flagged
    step changes nothing; offloaded and reloaded, the state goes on as before."""
    dtype = getattr(torch, param_dtype)
    model = _model(CODED).to(dtype)
    kwargs = {"lr": 1e-2, "weight_decay": 0.1, "fused": True, "moment_dtype": "8bit"}
    settings = MP(param_dtype=param_dtype, loss_scaling="static",
                  store_param_remainders=remainders)  # fmt: skip
    mp = MixedPrecisionOptimizersContainer([model], LeanAdamW, kwargs, settings=settings)
    (flat,) = mp.precision._flat[id(mp.optimizers[0])]
    flat.chunk(4 * PAD)  # runs of a few rows
    masters = [nn.Parameter(p.detach().float()) for p in _model(CODED).to(dtype).parameters()]
    ref = LeanAdamW(masters, **kwargs)
    for step in range(4):
        grads = [g.to(dtype) for g in _grads(CODED, step)]
        if step == 2:  # a flagged step: nothing moves
            before = {k: _clone(v) for k, v in mp.state_dict().items()}
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            mp.precision.unscale = FACTOR
            mp.precision.apply(mp.optimizers, found_inf=torch.ones(()))
            _same_state(mp.state_dict(), before)
            mp.precision.offload(mp.optimizers)
            mp.precision.reload(mp.optimizers)
        _step(mp, model, grads, FACTOR)
        for m, g in zip(masters, grads):
            m.grad = g.float() * FACTOR
        ref.step()
    state = mp.state_dict()
    assert isinstance(state["state.w0.exp_avg.code"], torch.Tensor)  # codes, not bf16
    assert state["state.w3.exp_avg"].dtype == torch.bfloat16  # a vector: bf16
    ours = {k.removeprefix("state."): v for k, v in state.items() if k.startswith("state.")}
    theirs = {}
    for i, m in enumerate(masters):
        for name, value in ref.state[m].items():
            if isinstance(value, dict):
                theirs |= {f"w{i}.{name}.{k}": v for k, v in value.items()}
            else:
                theirs[f"w{i}.{name}"] = value
    _same_state(ours, theirs)
    for i, (p, m) in enumerate(zip(model.parameters(), masters)):
        assert torch.equal(state[f"master_weights.w{i}"], m.detach()), i
        if not remainders:  # (remainders round half away from zero: their own bf16)
            assert torch.equal(p, m.detach().to(dtype)), i


def _clone(v):
    return v.clone() if isinstance(v, torch.Tensor) else v


def _same_state(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == b[key].dtype and torch.equal(value, b[key]), key
        else:
            assert value == b[key], key
