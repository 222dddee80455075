"""containers/update/compiled.py: Adam/AdamW as one inductor graph a tensor over its stored
forms (`implementation = "compiled"`, and under mixed precision)."""

from __future__ import annotations

import pytest
import torch

from components.optimizer import build_optimizers
from config import ConfigError
from config import Optimizer as OptimizerConfig
from containers import LeanAdam, LeanAdamW, OptimizersContainer, OptimizersInBackwardContainer
from containers.update.forms import MOMENT_CODECS
from tests.harness.helpers import (
    assert_same,
    compiled_calls,
    full_state,
    loose_params,
    optimizer_state,
    same_grads,
    three_parts,
    train,
)

# A large tensor, a small one, a 3-d one, a matrix.
SHAPES = [(300, 1000), (33,), (3, 5, 7), (64, 48)]


def _params(seed: int = 0) -> list[torch.Tensor]:
    return loose_params(SHAPES, seed)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """One update apart by a few fp32 ulp (rtol 1e-6; atol 1e-7, as a moment near 0 is a
    difference of terms ~0.1 in size), or by one bf16 ulp for bf16 values (a rounding of two
    fp32 values a few ulp apart can fall either side), but for at most 1 element in 10^4:
    where the gradient cancels (L2 decay against it) to ~1e-7, sqrt(v) is within a few eps
    and the update's size follows the last places of that difference (still within lr/1000)."""
    diff, size = (a.float() - b.float()).abs(), b.float().abs()
    ulp = torch.finfo(torch.bfloat16).eps if a.dtype == torch.bfloat16 else 1e-6
    assert (diff > ulp * size + 1e-7).sum() <= max(1, a.numel() // 10_000)
    assert (diff <= 2 * ulp * size + 1e-5).all()


@pytest.mark.parametrize("moment_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (LeanAdamW, {"lr": 1e-2, "weight_decay": 0.1}),
        (LeanAdam, {"lr": 1e-2, "weight_decay": 0.1, "maximize": True, "betas": (0.8, 0.99)}),
    ],
    ids=["AdamW", "Adam-L2-maximize"],
)
@pytest.mark.slow
def test_a_compiled_step_is_the_fused_step_within_a_few_ulp_in_the_moments_dtype(
    cls, kwargs, moment_dtype, monkeypatch
):
    """Each step from the same state: the graph's parameters and moments within a few fp32
    ulp of the fused kernel's (on the widened moments, rounded back, for bf16), the moments
    kept in their dtype, the step counts equal."""
    calls = compiled_calls(monkeypatch)
    ours, ref_params = _params(), _params()
    compiled = cls(ours, moment_dtype=moment_dtype, compiled=True, **kwargs)
    ref = cls(ref_params, moment_dtype=moment_dtype, fused=True, **kwargs)
    for step in range(4):
        same_grads(step, ours, ref_params)
        compiled.step()
        ref.step()
        for a, b in zip(ours, ref_params):
            _close(a.detach(), b.detach())
            for name in ("exp_avg", "exp_avg_sq"):
                kept = compiled.state[a][name]
                assert kept.dtype == getattr(torch, moment_dtype)
                _close(kept, ref.state[b][name])
                ref.state[b][name].copy_(kept)  # both go on from the same state
            assert torch.equal(compiled.state[a]["step"], ref.state[b]["step"])
            with torch.no_grad():
                b.copy_(a)
    assert len(calls) == 4 * len(SHAPES)  # one graph call a tensor


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["8bit", "4bit"])
def test_a_compiled_coded_step_is_the_eager_coded_step_within_a_few_ulp_and_a_flag_skips_it(
    kind, monkeypatch
):
    """8-bit (or 4-bit) moments in the graph (decoded, updated, encoded again): from the
    same state each step, the parameters within a few fp32 ulp of the eager step's (torch's
    fused kernel on the decoded moments), the codes the same but where a moment lies within
    those ulp of the boundary between two codes; the tensors the graph does not take (rows
    not of whole blocks, small ones in bf16) step as in eager. A flagged step (`found_inf`)
    changes nothing."""
    calls = compiled_calls(monkeypatch)
    shapes = [(64, 96), (33, 64), (5, 7), (40,), (96, 64)]
    kwargs = {"lr": 1e-2, "weight_decay": 0.1, "moment_dtype": kind}
    code = MOMENT_CODECS[kind].CODE
    ours, ref_params = loose_params(shapes), loose_params(shapes)
    compiled = LeanAdamW(ours, compiled=True, **kwargs)
    ref = LeanAdamW(ref_params, **kwargs)
    differ = total = 0
    for step in range(3):
        same_grads(step, ours, ref_params)
        compiled.step()
        ref.step()
        for a, b in zip(ours, ref_params):
            _close(a.detach(), b.detach())
            for name in ("exp_avg", "exp_avg_sq"):
                kept, want = compiled.state[a][name], ref.state[b][name]
                if not isinstance(kept, dict):  # (bf16 moments of a small parameter)
                    _close(kept, want)
                    want.copy_(kept)
                    continue
                differ += int((kept[code] != want[code]).sum())
                total += kept[code].numel()
                _close(kept["scale"], want["scale"])
                for k in kept:
                    want[k].copy_(kept[k])  # both go on from the same state
            with torch.no_grad():
                b.copy_(a)
    # one graph call a tensor but (5, 7), whose rows are not whole blocks (its 4-bit moments
    # are bf16: rows of an odd length)
    graphed = 4 if kind == "8bit" else 5
    assert len(calls) == 3 * graphed and total > 0 and differ <= total // 1000, (differ, total)

    before = [p.detach().clone() for p in ours], optimizer_state(compiled)
    same_grads(3, ours)
    compiled.found_inf = torch.ones(())  # as the container's check sets it on CUDA
    compiled.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, before[0]))
    assert_same(optimizer_state(compiled), before[1])


@pytest.mark.parametrize("kind", ["8bit", "4bit"])
def test_a_coded_tensor_in_runs_of_a_few_rows_steps_as_in_one_and_a_flag_keeps_tiny_moments(
    kind, monkeypatch
):
    """The graph takes a coded tensor in runs of the device's scratch size: in runs of 4 rows
    of blocks it steps bit for bit as in one run. A flagged step keeps the codes as they were,
    also of moments below fp32's normal range, whose decoded values would not code back."""
    import containers.update.compiled as module

    shapes = [(64, 96), (96, 64)]
    kwargs = {"lr": 1e-2, "weight_decay": 0.1, "moment_dtype": kind, "compiled": True}
    whole, runs = loose_params(shapes), loose_params(shapes)
    one, many = LeanAdamW(whole, **kwargs), LeanAdamW(runs, **kwargs)
    calls = compiled_calls(monkeypatch)
    for step in range(2):
        same_grads(step, whole, runs)
        one.step()
        with monkeypatch.context() as patch:
            patch.setattr(module, "scratch_numel", lambda device: 4 * 32)
            many.step()
    assert len(calls) == 2 * (2 + 2 * 64 * 96 // (4 * 32))  # one run, then 48 runs, a tensor
    assert all(torch.equal(a, b) for a, b in zip(whole, runs))
    assert_same(optimizer_state(many), optimizer_state(one))

    for p in runs:
        many.state[p]["exp_avg_sq"]["scale"].mul_(2.0**-120)  # maxima near 2^-130
    before = [p.detach().clone() for p in runs], optimizer_state(many)
    same_grads(2, runs)
    many.found_inf = torch.ones(())
    many.step()
    assert all(torch.equal(a, b) for a, b in zip(runs, before[0]))
    assert_same(optimizer_state(many), before[1])


@pytest.mark.parametrize("timing", ["after", "in_backward"])
@pytest.mark.slow
def test_containers_step_compiled_groups_and_resume_from_their_checkpoint_bitwise(
    timing, monkeypatch
):
    """The grouped step (all parts' like groups in one graph) and the in-backward units (one
    graph per unit) step `implementation = "compiled"` groups; the checkpoint is the usual
    format, and a run resumed from it continues bit for bit."""
    calls = compiled_calls(monkeypatch)
    cls = OptimizersInBackwardContainer if timing == "in_backward" else OptimizersContainer
    kwargs = {"lr": 1e-2, "moment_dtype": "bfloat16", "compiled": True}

    def build(seed: int = 0) -> tuple[list, OptimizersContainer]:
        parts = three_parts(seed)
        return parts, cls(parts, LeanAdamW, kwargs)

    parts, container = build()
    train(parts, container, 2)
    assert calls
    saved = full_state(container)
    assert saved["state.embed.weight.exp_avg"].dtype == torch.bfloat16
    assert not any(k.endswith((".compiled", ".moment_dtype")) for k in saved)  # run choices
    resumed_parts, resumed = build(seed=1)
    for part, to in zip(parts, resumed_parts):
        to.load_state_dict(part.state_dict())
    resumed.load_state_dict(saved)
    train(parts, container, 2, start=2)
    train(resumed_parts, resumed, 2, start=2)
    assert_same(full_state(resumed), full_state(container))
    for a, b in zip(parts, resumed_parts):
        assert_same(a.state_dict(), b.state_dict())


def test_the_config_builds_compiled_groups_and_refuses_what_has_no_compiled_step():
    container = build_optimizers(three_parts(), OptimizerConfig(implementation="compiled"))
    assert {type(o) for o in container} == {LeanAdamW}
    assert all(g["compiled"] and g["moment_dtype"] == "float32" for g in container.param_groups)
    with pytest.raises(ConfigError, match="implementation = 'compiled': SGD has no compiled"):
        build_optimizers(three_parts(), OptimizerConfig(name="SGD", implementation="compiled"))
    with pytest.raises(ValueError, match="compiled = True with amsgrad = True"):
        LeanAdamW(_params(), compiled=True, amsgrad=True)
    # A torch AdamW's state dict loads into a compiled LeanAdamW, which stays compiled.
    params = _params()
    plain = torch.optim.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.ones_like(p)
    plain.step()
    compiled = LeanAdamW(_params(), lr=1e-2, compiled=True)
    compiled.load_state_dict(plain.state_dict())
    assert all(g["compiled"] for g in compiled.param_groups)
