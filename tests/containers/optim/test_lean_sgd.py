"""LeanSGD (and ShardedMuon's `moment_dtype`): momentum kept in bf16, updated in fp32."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from config import Optimizer as OptimizerConfig
from config import ParamGroup
from containers import LeanSGD, ShardedMuon
from tests.harness.helpers import three_parts, train

SHAPES = [(64, 48), (33, 5), (7, 3)]  # matrices, as Muon takes


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in SHAPES]


def _round_buffers(opt: torch.optim.Optimizer) -> None:
    """What a lean step does to the fp32 reference: its momentum rounded to bf16."""
    for st in opt.state.values():
        st["momentum_buffer"].copy_(st["momentum_buffer"].bfloat16())


@pytest.mark.parametrize(
    ("cls", "ref_cls", "kwargs"),
    [
        (LeanSGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}),
        (
            LeanSGD,
            torch.optim.SGD,
            {"lr": 0.1, "momentum": 0.8, "nesterov": True, "maximize": True},
        ),
        (LeanSGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.3}),
        (ShardedMuon, ShardedMuon, {"lr": 0.02, "ns_dtype": "float32"}),
    ],
    ids=["sgd", "sgd_nesterov", "sgd_dampening", "muon"],
)
def test_a_lean_step_is_the_fp32_step_on_the_widened_momentum_rounded_back(cls, ref_cls, kwargs):
    lean_params, ref_params = _params(), _params()
    lean = cls(lean_params, moment_dtype="bfloat16", **kwargs)
    ref = ref_cls(
        ref_params, **({"foreach": False} if ref_cls is torch.optim.SGD else {}), **kwargs
    )
    for step in range(4):
        g = torch.Generator().manual_seed(100 + step)
        for i, (a, b) in enumerate(zip(lean_params, ref_params)):
            unused = step == 1 and i == 1  # its buffer starts a step later
            a.grad = None if unused else torch.randn(a.shape, generator=g)
            b.grad = None if unused else a.grad.clone()
        lean.step()
        ref.step()
        _round_buffers(ref)
        for a, b in zip(lean_params, ref_params):
            assert torch.equal(a, b)
            buf = lean.state[a]["momentum_buffer"]
            assert buf.dtype == torch.bfloat16
            assert torch.equal(buf.float(), ref.state[b]["momentum_buffer"])


@pytest.mark.parametrize("cls", [LeanSGD, ShardedMuon])
def test_a_load_keeps_each_groups_momentum_dtype(cls):
    kwargs = {"lr": 0.02, "momentum": 0.9}
    params = _params()
    lean = cls(params, moment_dtype="bfloat16", **kwargs)
    for p in params:
        p.grad = torch.randn(p.shape)
    lean.step()
    saved = lean.state_dict()
    again = cls(_params(1), moment_dtype="bfloat16", **kwargs)
    again.load_state_dict(saved)  # torch's own load would cast them to fp32
    wide = cls(_params(1), moment_dtype="float32", **kwargs)
    wide.load_state_dict(saved)
    for p, q, r in zip(params, again.state.values(), wide.state.values()):
        buf = lean.state[p]["momentum_buffer"]
        assert q["momentum_buffer"].dtype == torch.bfloat16
        assert torch.equal(q["momentum_buffer"], buf)
        assert r["momentum_buffer"].dtype == torch.float32
        assert torch.equal(r["momentum_buffer"], buf.float())


def test_the_config_builds_lean_sgd_per_group_and_dcp_resumes_it_in_its_dtypes(tmp_path):
    from components.optimizer import build_optimizers

    cfg = OptimizerConfig(
        name="SGD",
        momentum=0.9,
        moment_dtype="bfloat16",
        param_groups=[ParamGroup(pattern="norm", moment_dtype="float32")],
    )
    parts = three_parts()
    container = build_optimizers(parts, cfg)
    assert {type(o) for o in container} == {LeanSGD}
    train(parts, container, 2)
    dcp.save({"optim": container}, checkpoint_id=str(tmp_path))
    fresh = build_optimizers(three_parts(1), cfg)  # templates of a container never stepped
    dcp.load({"optim": fresh}, checkpoint_id=str(tmp_path))
    saved, got = container.state_dict(), fresh.state_dict()
    buffers = [k for k in saved if k.endswith("momentum_buffer")]
    for key in buffers:
        want = torch.float32 if "norm" in key else torch.bfloat16
        assert saved[key].dtype == got[key].dtype == want, key
        assert torch.equal(saved[key], got[key]), key


def test_a_float32_group_beside_a_lean_one_steps_as_torchs_sgd_with_a_grad_scale():
    """GradScaler's fused path sets `grad_scale` / `found_inf` on the optimizer: the float32
    group takes them as torch's SGD does (its fused kernel unscales the gradients)."""
    lean_params, ref_params = _params(), _params()
    kw = {"lr": 0.1, "momentum": 0.9, "fused": True}
    lean = LeanSGD(
        [{"params": lean_params[:1], "moment_dtype": "bfloat16"}, {"params": lean_params[1:]}],
        **kw,
    )
    ref = torch.optim.SGD(ref_params[1:], **kw)
    for opt in (lean, ref):
        opt.grad_scale = torch.tensor(4.0)
        opt.found_inf = torch.tensor(0.0)
    for p, q in zip(lean_params, ref_params):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 4
        q.grad = p.grad.clone()
    lean.step()
    ref.step()
    assert all(torch.equal(a, b) for a, b in zip(lean_params[1:], ref_params[1:]))
