"""LeanAdam/LeanAdamW: bf16 moments, fp32 math, torch's fused kernel; kept through loads."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import containers.update.driver as driver
from config import ConfigError, MixedPrecision, ParamGroup
from config import Optimizer as OptimizerConfig
from containers import (
    LeanAdam,
    LeanAdamW,
    OptimizersContainer,
    OptimizersInBackwardContainer,
    ParamGroupRule,
)
from containers.update.forms import MOMENT_CODECS, to_values
from tests.harness.dist import run_ranks
from tests.harness.helpers import (
    assert_same,
    full,
    loose_params,
    same_grads,
    sharded_three_parts,
    three_parts,
    train,
)

MOMENTS = ("exp_avg", "exp_avg_sq")
# A tensor spanning several chunks, small ones batched into one chunk.
SHAPES = [(700, 1000), (33,), (3, 5, 7), (64, 48)]


def _params(seed: int = 0) -> list[torch.Tensor]:
    return loose_params(SHAPES, seed)


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (LeanAdamW, {"lr": 1e-2, "weight_decay": 0.1}),
        (LeanAdam, {"lr": 1e-2, "weight_decay": 0.1}),
        (LeanAdamW, {"lr": 1e-3, "amsgrad": True, "maximize": True, "betas": (0.8, 0.99)}),
    ],
)
def test_a_lean_step_is_torchs_fused_step_on_the_widened_moments_rounded_back(
    cls, kwargs, monkeypatch
):
    monkeypatch.setattr(driver, "scratch_numel", lambda _: 1 << 18)  # chunks of a tensor
    lean_params, ref_params = _params(), _params()
    lean = cls(lean_params, moment_dtype="bfloat16", **kwargs)
    torch_cls = torch.optim.AdamW if cls is LeanAdamW else torch.optim.Adam
    ref = torch_cls(ref_params, fused=True, **kwargs)
    names = (*MOMENTS, "max_exp_avg_sq") if kwargs.get("amsgrad") else MOMENTS
    for step in range(4):
        same_grads(step, lean_params, ref_params)
        lean.step()
        ref.step()
        for a, b in zip(lean_params, ref_params):
            assert torch.equal(a, b), step
            for name in names:
                kept = lean.state[a][name]
                assert kept.dtype == torch.bfloat16
                assert torch.equal(kept, ref.state[b][name].bfloat16()), (step, name)
                ref.state[b][name].copy_(kept)  # the reference goes on from the rounded values
            assert torch.equal(lean.state[a]["step"], ref.state[b]["step"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's CUDA kernel, on a GPU only")
def test_where_torchs_kernel_takes_bf16_moments_a_lean_step_is_torchs_over_bf16_state():
    """torch's mixed-precision CUDA kernel steps the bf16 moments as they are: a lean step is
    torch's AdamW(fused=True) whose state was made bf16 before its first step (torchtitan's
    recipe), bit for bit."""
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    shapes = [(700, 1000), (33,), (3, 5, 7)]
    lean_params = [torch.randn(s, generator=g).to(device).requires_grad_() for s in shapes]
    ref_params = [p.detach().clone().requires_grad_() for p in lean_params]
    lean = LeanAdamW(lean_params, lr=1e-2, weight_decay=0.1, moment_dtype="bfloat16")
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, fused=True)
    for p in ref_params:
        zeros = {name: torch.zeros_like(p, dtype=torch.bfloat16) for name in MOMENTS}
        ref.state[p] = {"step": torch.zeros((), device=device), **zeros}
    for step in range(4):
        for a, b in zip(lean_params, ref_params):
            a.grad = torch.randn(a.shape, generator=g).to(device)
            b.grad = a.grad.clone()
        lean.step()
        ref.step()
        for a, b in zip(lean_params, ref_params):
            assert torch.equal(a, b), step
            for name in MOMENTS:
                assert lean.state[a][name].dtype == torch.bfloat16
                assert torch.equal(lean.state[a][name], ref.state[b][name]), (step, name)


@pytest.mark.parametrize("kernel", [{"fused": True}, {"foreach": True}, {"foreach": False}])
def test_a_float32_group_is_torchs_adamw_bitwise(kernel):
    a_params, b_params = _params(), _params()
    lean = LeanAdamW(a_params, lr=1e-2, moment_dtype="float32", **kernel)
    ref = torch.optim.AdamW(b_params, lr=1e-2, **kernel)
    for step in range(3):
        for a, b in zip(a_params, b_params):
            a.grad = torch.full_like(a, 0.1 * (step + 1)) + a.detach().sin()
            b.grad = a.grad.clone()
        lean.step()
        ref.step()
    for a, b in zip(a_params, b_params):
        assert torch.equal(a, b)
        assert all(lean.state[a][n].dtype == torch.float32 for n in MOMENTS)


def _container(seed: int = 0, timing: str = "after", **lean) -> tuple[list, OptimizersContainer]:
    parts = three_parts(seed)
    cls = OptimizersInBackwardContainer if timing == "in_backward" else OptimizersContainer
    rules = [ParamGroupRule(r"bias|norm", {"weight_decay": 0.0, "moment_dtype": "float32"})]
    kwargs = {"lr": 1e-2, "fused": True, "moment_dtype": "bfloat16", **lean}
    return parts, cls(parts, LeanAdamW, kwargs, param_groups=rules)


@pytest.mark.parametrize("moments", ["bfloat16", "8bit"])
@pytest.mark.parametrize("timing", ["after", "in_backward"])
def test_containers_step_lean_groups_as_one_lean_optimizer_per_part(timing, moments):
    """The grouped step (one kernel call per bucket) and the in-backward timing give what each
    part's own LeanAdamW gives; per-group dtypes hold (biases and norms kept fp32 here)."""
    parts, container = _container(timing=timing, moment_dtype=moments)
    ref_parts = three_parts(0)
    refs = []
    for part in ref_parts:
        decay = [p for n, p in part.named_parameters() if "bias" not in n and "norm" not in n]
        rest = [p for n, p in part.named_parameters() if "bias" in n or "norm" in n]
        groups = [{"params": decay}]
        groups += [{"params": rest, "weight_decay": 0.0, "moment_dtype": "float32"}] if rest else []
        refs.append(LeanAdamW(groups, lr=1e-2, fused=True, moment_dtype=moments))

    class Each:
        def zero_grad(self):
            for o in refs:
                o.zero_grad()

        def step(self):
            for o in refs:
                o.step()

    train(parts, container, 3)
    train(ref_parts, Each(), 3)
    for part, ref in zip(parts, ref_parts):
        for (name, p), q in zip(part.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), name
    sd = container.state_dict()
    if moments == "8bit":
        assert sd["state.embed.weight.exp_avg.code"].dtype == torch.int8
        assert sd["state.embed.weight.exp_avg_sq.scale"].shape == (7, 1)  # a block a row
    else:
        assert sd["state.embed.weight.exp_avg"].dtype == torch.bfloat16
    assert sd["state.embed.bias.exp_avg"].dtype == torch.float32
    assert not any(k.endswith(".moment_dtype") for k in sd)  # storage, not a hyperparameter


@pytest.mark.parametrize("moments", ["bfloat16", "8bit"])
def test_a_lean_state_loads_without_a_copy_and_resumes_bitwise(moments):
    parts, container = _container(moment_dtype=moments)
    train(parts, container, 3)
    sd = container.state_dict()
    resumed_parts, resumed = _container(seed=1, moment_dtype=moments)
    for src, dst in zip(parts, resumed_parts):
        dst.load_state_dict(src.state_dict())
    resumed.load_state_dict(sd)
    loaded = resumed.state_dict()
    for key, value in sd.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            # The dict's own tensors, kept in their dtype: nothing was widened or copied.
            assert loaded[key].data_ptr() == value.data_ptr(), key
    train(parts, container, 2, start=3)
    train(resumed_parts, resumed, 2, start=3)
    assert_same(resumed.state_dict(), container.state_dict())


def test_policies_convert_both_ways_on_load():
    parts, lean = _container()
    train(parts, lean, 2)
    plain_parts = three_parts(0)
    plain = OptimizersContainer(plain_parts, torch.optim.AdamW, {"lr": 1e-2, "fused": True})
    train(plain_parts, plain, 2)

    _, lean_fresh = _container()
    lean_fresh.load_state_dict(plain.state_dict())  # fp32 -> bf16: rounded to nearest
    _, plain_fresh = _container(moment_dtype="float32")
    plain_fresh.load_state_dict(lean.state_dict())  # bf16 -> fp32: widened exactly
    got, fp32, bf16 = lean_fresh.state_dict(), plain.state_dict(), lean.state_dict()
    for key, value in fp32.items():
        if key.endswith(MOMENTS) and "bias" not in key and "norm" not in key:
            assert got[key].dtype == torch.bfloat16
            assert torch.equal(got[key], value.bfloat16()), key
    widened = plain_fresh.state_dict()
    for key, value in bf16.items():
        if key.endswith(MOMENTS):
            assert widened[key].dtype == torch.float32
            assert torch.equal(widened[key], value.float()), key


def _sharded_lean(seed: int, moments: str) -> tuple[list[nn.Module], OptimizersContainer]:
    parts = sharded_three_parts(seed)
    return parts, OptimizersContainer(
        parts, LeanAdamW, {"lr": 1e-2, "fused": True, "moment_dtype": moments}
    )


def _save_lean(path: str, moments: str) -> tuple[dict, str]:
    parts, container = _sharded_lean(0, moments)
    train(parts, container, 3, rank=dist.get_rank())
    dcp.save({"optim": container}, checkpoint_id=path)
    # A row cut inside a block (tensor parallel on columns): 8-bit groups keep bf16 for it.
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cut = nn.Linear(40, 4, bias=False)
    cut.weight = nn.Parameter(distribute_tensor(cut.weight.detach(), mesh, [Shard(1)]))
    kept = OptimizersContainer([cut], LeanAdamW, {"moment_dtype": moments})
    cut.weight.grad = distribute_tensor(torch.ones(4, 40), mesh, [Shard(1)])
    kept.step()
    return {k: full(v) for k, v in container.state_dict().items()}, {
        k: (v.dtype, tuple(v.shape)) for k, v in kept.state_dict().items() if k.startswith("state.")
    }


def _columns_cut(seed: int) -> list[nn.Module]:
    """`three_parts(seed)` with every matrix sharded on its columns over all ranks (as
    tensor parallelism's rowwise layers are), the rest replicated: 3 ranks cut every row
    inside its block of 32."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parts = three_parts(seed)
    for part in parts:
        for module in part.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                placement = Shard(1) if p.dim() == 2 else Replicate()
                placed = distribute_tensor(p.detach(), mesh, [placement])
                setattr(module, name, nn.Parameter(placed))
    return parts


def _load_lean(path: str, moments: str) -> list[dict]:
    """The checkpoint loaded by a run of its own policy and by one of torch's AdamW, on FSDP2
    and on columns cut inside blocks (each template fitted to the checkpoint's keys first, as
    a checkpoint load does)."""
    loaded = []
    for cls, kwargs in [(LeanAdamW, {"moment_dtype": moments}), (torch.optim.AdamW, {})]:
        for layout in (sharded_three_parts, _columns_cut):
            container = OptimizersContainer(layout(1), cls, {"lr": 1e-2, **kwargs})
            keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
            container.check_checkpoint_keys([k.removeprefix("optim.") for k in keys])
            dcp.load({"optim": container}, checkpoint_id=path)
            loaded.append({k: full(v) for k, v in container.state_dict().items()})
    return loaded


@pytest.mark.parametrize("moments", ["bfloat16", "8bit", "4bit"])
@pytest.mark.slow
def test_lean_state_saved_on_2_fsdp2_ranks_loads_on_3_element_for_element(tmp_path, moments):
    path = str(tmp_path / "ckpt")
    saved, cut = run_ranks(2, _save_lean, path, moments)[0]
    codec = MOMENT_CODECS[moments]
    if moments == "8bit":
        assert saved["state.mid.weight.exp_avg_sq.code"].dtype == torch.uint8
        scale = saved["state.mid.weight.exp_avg_sq.scale"]
        assert scale.shape == (9, 1) and scale.count_nonzero() == 9  # rows 5 + 4, then 3 x 3
    elif moments == "4bit":  # (mid's rows of 7 keep bf16: codes take rows of whole bytes)
        assert saved["state.embed.weight.exp_avg_sq.nibbles"].shape == (7, 5)
        scale = saved["state.embed.weight.exp_avg_sq.scale"]
        assert scale.shape == (7, 1) and scale.count_nonzero() == 7  # rows 4 + 3, then 3 x 3
    else:
        assert saved["state.embed.weight.exp_avg"].dtype == torch.bfloat16
    # cut at column 20 of 40, inside a block: bf16 moments (elementwise: any cut will do)
    kept = (torch.bfloat16, (4, 40))
    assert cut["state.weight.exp_avg"] == cut["state.weight.exp_avg_sq"] == kept
    same, cut_same, widened, cut_widened = run_ranks(3, _load_lean, path, moments)[0]
    assert_same(same, saved)
    # torch's AdamW: the moments as fp32 tensors; columns cut inside blocks: as bf16 (8-bit
    # groups keep bf16 there), decoded from the whole tensor's codes
    for loaded, dtype in ((widened, torch.float32), (cut_widened, torch.float32),
                          (cut_same, torch.bfloat16)):  # fmt: skip
        for key, value in loaded.items():
            name = key.rsplit(".", 1)[-1]
            if name in MOMENTS:
                codes = {k: saved.get(f"{key}.{k}") for k in (getattr(codec, "CODE", ""), "scale")}
                kept = saved.get(key, codes)
                want = to_values(name, kept).float().to(dtype)
                assert value.dtype == dtype and torch.equal(value, want), key


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (
            OptimizerConfig(name="Adagrad", moment_dtype="bfloat16"),
            r"moment_dtype = 'bfloat16': Adagrad keeps its state in the parameters' dtype",
        ),
        (
            OptimizerConfig(
                param_groups=[ParamGroup(pattern="w", name="Adagrad")], moment_dtype="bfloat16"
            ),
            r"param_groups\[0\]\] moment_dtype = 'bfloat16': Adagrad",
        ),
        (
            OptimizerConfig(moment_dtype="bfloat16", implementation="foreach"),
            r"implementation = 'foreach': bf16 moments .* use implementation 'auto' or 'fused'",
        ),
        (
            OptimizerConfig(name="SGD", momentum=0.9, moment_dtype="8bit"),
            r"moment_dtype = '8bit': codes are Adam's and AdamW's moments, not SGD's",
        ),
        (
            OptimizerConfig(name="Muon", moment_dtype="8bit"),
            r"not Muon's state; use moment_dtype = 'bfloat16'",
        ),
    ],
)
def test_lean_moments_where_they_do_not_apply_are_refused_by_name(cfg, match):
    from components.optimizer import build_optimizers, build_precision, cast_model

    precision = build_precision(cfg, MixedPrecision())
    parts = [cast_model(precision, part) for part in three_parts()]
    with pytest.raises(ConfigError, match=match):
        build_optimizers(parts, cfg, precision=precision)


def test_the_config_builds_lean_adamw_with_per_group_dtypes():
    from components.optimizer import build_optimizers

    cfg = OptimizerConfig(
        moment_dtype="bfloat16", param_groups=[ParamGroup(pattern="norm", moment_dtype="float32")]
    )
    container = build_optimizers(three_parts(), cfg)
    assert {type(o) for o in container} == {LeanAdamW}
    dtypes = {g["moment_dtype"] for g in container.param_groups}
    assert dtypes == {"bfloat16", "float32"}
    plain = build_optimizers(three_parts(), OptimizerConfig())
    assert {type(o) for o in plain} == {torch.optim.AdamW}  # today's class when nothing asks


@pytest.mark.parametrize(
    "kwargs", [{"moment_dtype": "bfloat16"}, {"moment_dtype": "8bit"}, {"compiled": True}]
)
def test_a_lean_or_compiled_group_refuses_a_parameter_that_is_not_contiguous(kwargs):
    """These groups step flat views: a strided parameter is refused by name when the group
    is built, never stepped through a copy of it."""
    strided = torch.randn(64, 48).t().requires_grad_()
    with pytest.raises(ValueError, match=r"shape \(48, 64\) is not contiguous"):
        LeanAdamW([torch.randn(8, requires_grad=True), strided], lr=1e-3, **kwargs)
    LeanAdamW([strided], lr=1e-3)  # fp32 moments, eager: torch's own step takes it


@pytest.mark.parametrize("copy", ["deepcopy", "pickle"])
def test_a_copied_lean_optimizer_steps_as_the_original(copy):
    """torch's pickle keeps defaults, state and groups: the plans are made again."""
    import copy as copy_module
    import pickle

    params = loose_params([(64, 96), (40,)])
    opt = LeanAdamW(params, lr=1e-2, moment_dtype="8bit")
    same_grads(0, params)
    opt.step()
    twin = copy_module.deepcopy(opt) if copy == "deepcopy" else pickle.loads(pickle.dumps(opt))
    twin_params = twin.param_groups[0]["params"]
    same_grads(1, params, twin_params)
    opt.step()
    twin.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twin_params))
