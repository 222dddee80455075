"""Routed experts held as grouped 3-D weights step exactly as the same experts held as E
separate 2-D matrices, on every update plan (ARCHITECTURE.md's table, and more)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from containers import (
    LeanAdamW,
    MixedPrecisionOptimizersContainer,
    MixedPrecisionSettings,
    OptimizersContainer,
    ShardedMuon,
    tensors,
)
from tests.harness.dist import run_ranks
from tests.harness.helpers import full, plan_table

E, DIM, HIDDEN, STEPS = 4, 32, 48, 4  # rows of 32 and 48: whole and partial 8-bit blocks
SHAPES = {"w1": (E, DIM, HIDDEN), "w3": (E, DIM, HIDDEN), "w2": (E, HIDDEN, DIM)}


class Router(nn.Module):
    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.gate = nn.Parameter(values["router"].clone())


class Grouped(nn.Module):
    """torchtitan's GroupedExperts weights: [E, dim, hidden] and [E, hidden, dim]."""

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.router = Router(values)
        for name in SHAPES:
            setattr(self, name, nn.Parameter(values[name].clone()))


class Separate(nn.Module):
    """The same experts as E separate matrices each (`w1.0` .. `w1.<E-1>`)."""

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.router = Router(values)
        for name in SHAPES:
            setattr(self, name, nn.ParameterList([v.clone() for v in values[name]]))


class Experts(nn.Module):
    """`module`'s experts without its router (a model part of their own)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        for name in SHAPES:
            setattr(self, name, getattr(module, name))


def _values(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"router": (DIM, E), **SHAPES}
    return {k: torch.randn(s, generator=g).to(dtype) for k, s in shapes.items()}


def _grads(grouped: Grouped, separate: Separate, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for name, p in grouped.named_parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        if name == "router.gate":
            separate.router.gate.grad = p.grad.clone()
        else:
            for q, slice_ in zip(getattr(separate, name), p.grad):
                q.grad = slice_.clone()


MP = MixedPrecisionOptimizersContainer
FUSED = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}
MP_8BIT = {**FUSED, "moment_dtype": "8bit"}
MP_4BIT = {**FUSED, "moment_dtype": "4bit"}
REMAINDERS = MixedPrecisionSettings(store_param_remainders=True)
CASES = {  # plan: (container, optimizer, kwargs, settings); bf16 parameters under a precision
    "torch fused": ("torch", OptimizersContainer, torch.optim.AdamW, FUSED, None),
    "torch foreach": ("torch", OptimizersContainer, torch.optim.AdamW, {"foreach": True}, None),
    "torch for-loop": ("torch", OptimizersContainer, torch.optim.AdamW, {"foreach": False}, None),
    "torch grouped": ("torch", OptimizersContainer, torch.optim.AdamW, FUSED, None),
    "bf16": (
        "chunked, bfloat16 moments", OptimizersContainer, LeanAdamW,
        {**FUSED, "moment_dtype": "bfloat16"}, None,
    ),
    "8bit": ("chunked, 8bit moments", OptimizersContainer, LeanAdamW, MP_8BIT, None),
    "4bit": ("chunked, 4bit moments", OptimizersContainer, LeanAdamW, MP_4BIT, None),
    "compiled": (
        "compiled, float32 moments", OptimizersContainer, LeanAdamW,
        {**FUSED, "compiled": True}, None,
    ),
    "compiled bf16": (
        "compiled, bfloat16 moments", OptimizersContainer, LeanAdamW,
        {**FUSED, "moment_dtype": "bfloat16", "compiled": True}, None,
    ),
    "8bit compiled": (
        "compiled, 8bit moments", OptimizersContainer, LeanAdamW,
        {**MP_8BIT, "compiled": True}, None,
    ),
    "masters": (
        "chunked, fp32 masters, float32 moments", MP, torch.optim.AdamW, FUSED,
        MixedPrecisionSettings(),
    ),
    "masters bf16": (
        "chunked, fp32 masters, bfloat16 moments", MP, LeanAdamW,
        {**FUSED, "moment_dtype": "bfloat16"}, MixedPrecisionSettings(),
    ),
    "masters 8bit": (
        "chunked, fp32 masters, 8bit moments", MP, LeanAdamW, MP_8BIT, MixedPrecisionSettings(),
    ),
    "remainders bf16": (
        "chunked, remainders masters, bfloat16 moments", MP, LeanAdamW,
        {**FUSED, "moment_dtype": "bfloat16"}, REMAINDERS,
    ),
    "remainders 8bit": (
        "chunked, remainders masters, 8bit moments", MP, LeanAdamW, MP_8BIT, REMAINDERS,
    ),
    "masters compiled": (
        "compiled, fp32 masters, float32 moments", MP, LeanAdamW, {**FUSED, "compiled": True},
        MixedPrecisionSettings(),
    ),
    "remainders compiled": (
        "compiled, remainders masters, float32 moments", MP, LeanAdamW,
        {**FUSED, "compiled": True}, REMAINDERS,
    ),
    "remainders 8bit compiled": (
        "compiled, remainders masters, 8bit moments", MP, LeanAdamW,
        {**MP_8BIT, "compiled": True}, REMAINDERS,
    ),
    "remainders 4bit": (
        "chunked, remainders masters, 4bit moments", MP, LeanAdamW, MP_4BIT, REMAINDERS,
    ),
    "remainders 4bit compiled": (
        "compiled, remainders masters, 4bit moments", MP, LeanAdamW,
        {**MP_4BIT, "compiled": True}, REMAINDERS,
    ),
    "masters per tensor": (
        "torch, fp32 masters", MP, torch.optim.AdamW, {"lr": 1e-2, "foreach": False},
        MixedPrecisionSettings(),
    ),
}  # fmt: skip


def test_every_plan_of_the_table_is_covered():
    assert {row["name"] for row in plan_table()} <= {case[0] for case in CASES.values()}


def _build(case: str, module: nn.Module) -> OptimizersContainer:
    _, container, cls, kwargs, settings = CASES[case]
    extra = {"settings": settings} if settings else {}
    if case == "torch grouped":  # router and experts in two parts: one functional call
        return container([module.router, Experts(module)], cls, kwargs)
    return container([module], cls, kwargs, **extra)


def _stacked(state: dict, name: str) -> dict[str, torch.Tensor]:
    """The separate run's entries of `name`'s slices, stacked as the grouped run's keys."""
    out: dict[str, list] = {}
    for key, value in state.items():
        for e in range(E):
            infix = f".{name}.{e}."
            if infix in f".{key}." and isinstance(value, torch.Tensor):
                grouped_key = f".{key}.".replace(infix, f".{name}.")[1:-1]
                out.setdefault(grouped_key, [None] * E)[e] = value
    return {k: torch.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_grouped_experts_step_as_separate_matrices_bitwise(case, monkeypatch):
    """Scratch of 1024 elements: chunks and runs of rows cut through experts."""
    monkeypatch.setattr(tensors, "SCRATCH_NUMEL", 1 << 10)
    monkeypatch.setattr(tensors, "_scratch", {})
    path, *_, settings = CASES[case]
    dtype = torch.bfloat16 if settings else torch.float32
    values = _values(dtype)
    grouped, separate = Grouped(values), Separate(values)
    opts = [_build(case, m) for m in (grouped, separate)]
    for step in range(STEPS):
        _grads(grouped, separate, step)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for opt in opts:
        groups = [(o, i) for o in opt for i in range(len(o.param_groups))]
        assert {opt.precision.plan(o, i).name for o, i in groups} == {path}
    got, want = ({k: full(v) for k, v in o.state_dict().items()} for o in opts)
    for name in SHAPES:
        assert torch.equal(getattr(grouped, name), torch.stack(list(getattr(separate, name))))
        stacked = _stacked(want, name)
        assert stacked, name
        for key, value in stacked.items():
            assert got[key].dtype == value.dtype, key
            if got[key].numel() == value[0].numel():  # the step: one count each
                value = value[:1]
            assert torch.equal(got[key].reshape(value.shape), value), key
    assert torch.equal(grouped.router.gate, separate.router.gate)


# -- Muon: each expert's matrix orthogonalized on its own ------------------------------------

MUON = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}


@pytest.mark.parametrize("ns_dtype", ["float32", "bfloat16"])
def test_muon_steps_each_expert_as_its_own_matrix_bitwise(ns_dtype):
    """The same computation: Newton-Schulz per [dim, hidden] slice, lr adjusted by its shape."""
    values = _values(torch.float32)
    grouped, separate = Grouped(values), Separate(values)
    kwargs = {**MUON, "ns_dtype": ns_dtype}
    opts = [OptimizersContainer([m], ShardedMuon, kwargs) for m in (grouped, separate)]
    for step in range(STEPS):
        _grads(grouped, separate, step)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    got, want = ({k: full(v) for k, v in o.state_dict().items()} for o in opts)
    for name in SHAPES:
        assert torch.equal(getattr(grouped, name), torch.stack(list(getattr(separate, name))))
        buffer = f"state.{name}.momentum_buffer"
        assert got[buffer].shape == SHAPES[name]  # torch's Muon state, as the parameter
        assert torch.equal(got[buffer], _stacked(want, name)[buffer])
    assert torch.equal(grouped.router.gate, separate.router.gate)


def _expert_parallel(layouts: list[str]) -> dict:
    """Per layout: the experts after Muon steps on DTensors, the placements, and one plain
    process's result of the same steps computed on this rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    world = torch.distributed.get_world_size()
    values = _values(torch.float32)
    kwargs = {**MUON, "ns_dtype": "float32"}
    plain = Grouped(values)
    ref_opt = ShardedMuon([getattr(plain, n) for n in SHAPES], **kwargs)
    out = {}
    for layout in layouts:
        model = Grouped(values)
        if layout == "ep":
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
            ep = mesh
        else:  # ep 2 x dp 2: FSDP2 over the ranks outside ep, on dim 0 or dim 1
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard_mod_ep", "ep"))
            ep = mesh["ep"]
        for name in SHAPES:
            p = getattr(model, name)
            setattr(model, name, nn.Parameter(distribute_tensor(p.data, ep, [Shard(0)])))
        if layout != "ep":
            place = Shard(int(layout[-1]))
            fully_shard(
                model, mesh=mesh["dp_shard_mod_ep"], shard_placement_fn=lambda _, s=place: s
            )
        opt = ShardedMuon([getattr(model, n) for n in SHAPES], **kwargs)
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 + step)
            for name in SHAPES:
                p, grad = getattr(model, name), torch.randn(SHAPES[name], generator=g)
                p.grad = distribute_tensor(grad, p.device_mesh, p.placements)
                if layout == layouts[0]:
                    getattr(plain, name).grad = grad
            opt.step()
            if layout == layouts[0]:
                ref_opt.step()
        buffers = [opt.state[getattr(model, n)]["momentum_buffer"] for n in SHAPES]
        out[layout] = {
            "weights": {n: full(getattr(model, n)) for n in SHAPES},
            "placements": {n: str(getattr(model, n).placements) for n in SHAPES},
            "buffers": {n: full(b) for n, b in zip(SHAPES, buffers)},
            "buffers_placed": all(
                b.placements == getattr(model, n).placements for n, b in zip(SHAPES, buffers)
            ),
            "exchanges": len(opt._exchanges),
        }
    out["plain"] = {n: full(getattr(plain, n)) for n in SHAPES}
    return out


def _check_expert_parallel(got: dict, layouts: list[str]) -> None:
    for layout in layouts:
        for name in SHAPES:  # the same computation as one process, in the same thread count
            assert torch.equal(got[layout]["weights"][name], got["plain"][name]), (layout, name)
        assert got[layout]["buffers_placed"], layout


@pytest.mark.parametrize("world", [2, 4])
def test_muon_on_expert_parallel_dtensors_matches_one_process(world):
    """EP alone (Shard(0) over ep: whole matrices, no exchange); at 4 ranks also EP 2 x FSDP 2
    on dim 0 (`_StridedShard(0)`: still whole matrices) and on dim 1 (each expert's matrix
    gathered by the exchange)."""
    layouts = ["ep"] if world == 2 else ["ep", "fsdp dim 0", "fsdp dim 1"]
    got = run_ranks(world, _expert_parallel, layouts)[0]
    _check_expert_parallel(got, layouts)
    assert got["ep"]["placements"]["w1"] == "(Shard(dim=0),)"
    assert got["ep"]["exchanges"] == 0
    if world == 4:
        assert got["fsdp dim 0"]["placements"]["w1"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        assert got["fsdp dim 0"]["exchanges"] == 0
        assert got["fsdp dim 1"]["placements"]["w1"] == "(Shard(dim=1), Shard(dim=0))"
        assert got["fsdp dim 1"]["exchanges"] > 0
