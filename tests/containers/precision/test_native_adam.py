"""containers/native_adam.py: the one-pass kernel steps as torch's fused Adam(W), bit for bit."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
import torch.nn as nn

from config import MixedPrecision as MP
from containers import MixedPrecisionOptimizersContainer
from containers.precision import native_adam
from containers.precision.flat_adam import PAD

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)

SIZES = [5, 16384, 7, 1, 3 * native_adam.BLOCK + 11, 64]  # one spans blocks and threads


@pytest.fixture(scope="module", params=[True, False], ids=["openmp", "one_thread"])
def kernel(request) -> native_adam.Kernel:
    """Both builds: with OpenMP (torch's libgomp here) and without (another runtime)."""
    k = native_adam.build(openmp=request.param)
    assert k is not None  # a compiler is here: it must build
    return k


def _starts(sizes: list[int]) -> list[int]:
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + -(-n // PAD) * PAD)
    return starts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("adamw", "wd", "maximize", "factor"),
    [(True, 0.1, False, 0.3), (False, 0.05, True, 1.0), (True, 0.0, False, 2.0**-10)],
)
def test_kernel_steps_as_torch_fused_adam_bitwise(kernel, dtype, adamw, wd, maximize, factor):
    torch.manual_seed(0)
    starts = _starts(SIZES)
    params = [torch.randn(n).to(dtype) for n in SIZES]
    buffers = {k: torch.zeros(starts[-1]) for k in ("master", "exp_avg", "exp_avg_sq")}
    for p, s in zip(params, starts):
        buffers["master"][s : s + p.numel()] = p.float()
    ref = {k: v.clone() for k, v in buffers.items()}
    plan = native_adam.Plan(params, starts)
    update = torch._fused_adamw_ if adamw else torch._fused_adam_
    hyper = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": wd}
    for step in (1.0, 2.0, 3.0):
        grads = [torch.randn(n).to(dtype) for n in SIZES]
        flags = {"adamw": adamw, "maximize": maximize, "step": step}
        assert kernel.adam(plan, grads, buffers, {**hyper, **flags}, factor)
        work = torch.zeros(starts[-1])
        for g, s in zip(grads, starts):
            work[s : s + g.numel()] = g.float()
        if factor != 1.0:
            work.mul_(factor)
        update(
            [ref["master"]], [work], [ref["exp_avg"]], [ref["exp_avg_sq"]], [],
            [torch.tensor(step)], amsgrad=False, maximize=maximize, **hyper,
        )  # fmt: skip
    for name in buffers:
        assert torch.equal(buffers[name], ref[name]), name
    for p, s in zip(params, starts):
        assert torch.equal(p, ref["master"][s : s + p.numel()].to(dtype))


def test_square_sum_is_fp64_accurate_and_only_non_finite_inputs_make_it_so(kernel):
    torch.manual_seed(1)
    grads = [torch.randn(n).bfloat16() for n in SIZES]
    exact = sum(g.double().square().sum().item() for g in grads)
    assert kernel.square_sum(grads) == pytest.approx(exact, rel=1e-6)
    huge = torch.zeros(300, dtype=torch.bfloat16)
    huge[7] = 1e20  # its fp32 square overflows; the gradient is finite
    assert kernel.square_sum([huge, *grads]) == pytest.approx(1e40 + exact, rel=1e-2)
    for bad in (math.inf, math.nan):
        g = grads[1].clone()
        g[3] = bad
        assert not math.isfinite(kernel.square_sum([grads[0], g]))
    assert kernel.square_sum([grads[1].view(128, 128).t()]) is None  # not contiguous


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Module()
    for i, n in enumerate([(4, 67), (300,), (7,), (64, 64)]):
        m.register_parameter(f"w{i}", nn.Parameter(torch.randn(n).to(torch.bfloat16)))
    return m


def _run(compile: bool, transposed: bool = False) -> tuple[dict, list[torch.Tensor], list]:
    model = _model()
    mp = MixedPrecisionOptimizersContainer(
        [model], torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True},
        settings=MP(loss_scaling="static", initial_scale=8.0, compile=compile),
    )  # fmt: skip
    for step in range(3):
        torch.manual_seed(10 + step)
        for p in model.parameters():
            g = torch.randn(p.shape[::-1]).t() if transposed and p.dim() == 2 else None
            p.grad = (g if g is not None else torch.randn(p.shape)).to(torch.bfloat16)
        mp.step()
    flats = mp.precision._flat[id(mp.optimizers[0])]
    return mp.state_dict(), [p.detach().clone() for p in model.parameters()], flats


@pytest.mark.parametrize("transposed", [False, True], ids=["one_pass", "unreadable_grads"])
def test_compiled_container_equals_the_eager_flat_step_bitwise(transposed):
    eager, eager_params, _ = _run(compile=False, transposed=transposed)
    native, native_params, flats = _run(compile=True, transposed=transposed)
    assert flats[0]._walk is not None  # the kernel was tried: non-contiguous gradients
    # then take the eager flat path, with the same result
    assert eager.keys() == native.keys()
    for key, value in eager.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(native[key], value), key
    for a, b in zip(eager_params, native_params):
        assert torch.equal(a, b)
