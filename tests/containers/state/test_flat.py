"""Direct tests of containers/flat_state.py and initial_state.py: key listings, nested
flattening, initial states."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch import optim
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from containers.state.flat import describe_keys, flatten_into, unflatten
from containers.state.initial import derive
from tests.harness.dist import run_ranks

# -- describe_keys ---------------------------------------------------------------------------


def test_describe_keys_sorts_and_lists_up_to_the_limit():
    assert describe_keys(["b", "c", "a"]) == "[a, b, c]"
    assert describe_keys(iter({"y", "x"})) == "[x, y]"
    eight = [f"k{i}" for i in range(8)]
    assert describe_keys(eight) == f"[{', '.join(eight)}]"  # exactly the limit: no "more"


def test_describe_keys_counts_what_it_leaves_out():
    keys = [f"k{i:02d}" for i in range(11, -1, -1)]  # 12 keys, given in reverse
    assert describe_keys(keys) == "[k00, k01, k02, k03, k04, k05, k06, k07, ... and 4 more]"
    assert describe_keys(keys, limit=2) == "[k00, k01, ... and 10 more]"
    assert describe_keys(["z", "a"], limit=1) == "[a, ... and 1 more]"


def test_describe_keys_of_nothing_is_none():
    assert describe_keys([]) == "none"
    assert describe_keys(set()) == "none"


# -- a real optimizer with nested, factored state (the shape of Shampoo's) ---------------------


class Factored(torch.optim.Optimizer):
    """Momentum SGD scaled by a factored second moment; state nests the factors in a dict.

    The state is fp32 whatever the parameter dtype, and two of its tensors are neither 0-d nor
    the parameter's shape.
    """

    def __init__(self, params: Any, lr: float = 0.1, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["momentum"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                    st["factors"] = {
                        "row": torch.zeros(p.shape[0], 1, device=p.device),
                        "col": torch.zeros(1, p.shape[1], device=p.device),
                    }
                    st["note"] = "factored"
                g = p.grad.float()
                st["step"] += 1
                f = st["factors"]
                f["row"].lerp_(g.square().mean(1, keepdim=True), 1 - group["beta"])
                f["col"].lerp_(g.square().mean(0, keepdim=True), 1 - group["beta"])
                st["momentum"].lerp_(g, 1 - group["beta"])
                scale = (f["row"] * f["col"] / f["row"].mean()).sqrt() + 1e-8
                p.sub_((st["momentum"] / scale).to(p.dtype), alpha=group["lr"])


def _factored_after_steps(steps: int, dtype: torch.dtype = torch.float32) -> tuple[Any, ...]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, 3, dtype=dtype)), nn.Parameter(torch.randn(2, 5))]
    opt = Factored(params)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return opt, params


def test_flatten_and_unflatten_round_trip_nested_state():
    opt, params = _factored_after_steps(2)
    flat: dict[str, Any] = {}
    for i, p in enumerate(params):
        flatten_into(flat, f"state.w{i}", opt.state[p])
    assert sorted(k for k in flat if k.startswith("state.w0.")) == [
        "state.w0.factors.col",
        "state.w0.factors.row",
        "state.w0.momentum",
        "state.w0.note",
        "state.w0.step",
    ]
    assert len(flat) == 10  # nothing of one parameter lands under the other's prefix
    for i, p in enumerate(params):
        back = unflatten(flat, f"state.w{i}", opt.state[p])
        assert back == {  # the very objects, in the same nesting
            "step": opt.state[p]["step"],
            "momentum": opt.state[p]["momentum"],
            "factors": opt.state[p]["factors"],
            "note": "factored",
        }
        assert back["factors"]["row"] is opt.state[p]["factors"]["row"]


def test_unflatten_reads_what_it_is_given_and_misses_loudly():
    like = {"step": 0, "factors": {"row": None, "col": None}, "empty": {}}
    flat = {"s.step": 7, "s.factors.row": "r", "s.factors.col": "c", "s.extra": "ignored"}
    assert unflatten(flat, "s", like) == {
        "step": 7,
        "factors": {"row": "r", "col": "c"},
        "empty": {},
    }
    del flat["s.factors.col"]
    with pytest.raises(KeyError, match=r"s\.factors\.col"):
        unflatten(flat, "s", like)


# -- derive against torch's own optimizers -----------------------------------------------------


def _params(two_d: bool = False, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    torch.manual_seed(0)
    shapes = [(4, 3), (5, 2)] if two_d else [(4, 3), (5, 2), (3,)]
    return [nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]


def _step(opt: torch.optim.Optimizer, params: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    opt.step()


def _layout(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (type(v).__name__, tuple(v.shape), v.dtype, v.device.type)
        if isinstance(v, torch.Tensor)
        else type(v).__name__
        for k, v in state.items()
    }


def _case(name: str, cls: type, kwargs: dict, **kw: Any) -> Any:
    return pytest.param(cls, kwargs, kw, id=name)


CASES = [
    _case("AdamW", optim.AdamW, {"weight_decay": 0.1}),
    _case("AdamW-bf16", optim.AdamW, {}, dtype=torch.bfloat16),
    _case("AdamW-fused", optim.AdamW, {"fused": True}),
    _case("Adam", optim.Adam, {}),
    _case("Adam-amsgrad", optim.Adam, {"amsgrad": True}),
    _case("SGD-momentum", optim.SGD, {"momentum": 0.9}),
    _case("SGD-nesterov", optim.SGD, {"momentum": 0.9, "nesterov": True}),
    _case("SGD-dampening", optim.SGD, {"momentum": 0.9, "dampening": 0.5}),
    _case("Adagrad", optim.Adagrad, {}),
    _case("Adagrad-accumulator", optim.Adagrad, {"initial_accumulator_value": 0.1}),
    _case("RMSprop", optim.RMSprop, {}),
    _case("RMSprop-centered", optim.RMSprop, {"centered": True, "momentum": 0.9}),
    _case("Adamax", optim.Adamax, {}),
    _case("NAdam", optim.NAdam, {}),
    _case("RAdam", optim.RAdam, {}),
    _case("Rprop", optim.Rprop, {}),
    _case("Adadelta", optim.Adadelta, {}),
    _case("Muon", optim.Muon, {}, two_d=True),
    _case("ASGD", optim.ASGD, {}),
    _case("Adafactor", optim.Adafactor, {}),
    _case("Adafactor-2d", optim.Adafactor, {}, two_d=True),
]


def _start(name: str, kwargs: dict) -> float:
    """Torch's start value of state `name` (lr is 0.1 in every case); most start at zero."""
    return {
        "eta": 0.1,  # ASGD
        "mu": 1.0,  # ASGD
        "sum": kwargs.get("initial_accumulator_value", 0.0),  # Adagrad
        "mu_product": 1.0,  # NAdam
        "step_size": 0.1,  # Rprop
    }.get(name, 0.0)


def _fresh(cls: type, kwargs: dict, kw: dict) -> tuple[torch.optim.Optimizer, list]:
    params = _params(**kw)
    return cls(params, lr=0.1, **kwargs), params


@pytest.mark.parametrize(("cls", "kwargs", "kw"), CASES)
def test_initial_state_has_the_names_shapes_dtypes_of_one_real_step_and_torchs_values(
    cls, kwargs, kw
):
    opt, params = _fresh(cls, kwargs, kw)
    before = {p: dict(opt.state[p]) for p in params if p in opt.state}  # Adagrad's eager state
    values = [p.detach().clone() for p in params]
    init = derive(opt, params, materialize=True).states
    # Derived without touching the optimizer: no state added, lr and parameters as they were.
    assert {p: dict(opt.state[p]) for p in params if p in opt.state} == before
    assert all(g["lr"] == 0.1 for g in opt.param_groups)
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    assert all(p.grad is None for p in params)

    _step(opt, params, seed=0)
    assert list(init) == params
    for p in params:
        assert _layout(init[p]) == _layout(opt.state[p])
        for name, value in init[p].items():
            assert torch.equal(value, torch.full_like(value, _start(name, kwargs))), name


@pytest.mark.parametrize(("cls", "kwargs", "kw"), CASES)
def test_stepping_from_the_initial_state_is_stepping_from_fresh(cls, kwargs, kw):
    fresh, params = _fresh(cls, kwargs, kw)
    resumed, copies = _fresh(cls, kwargs, kw)
    derived = derive(resumed, copies, materialize=True)
    for q in copies:
        # What a load does: a placeholder of state that only the first update creates
        # (SGD's momentum_buffer, the first gradient itself) is left out while still zero.
        resumed.state[q] = {
            k: v for k, v in derived.states[q].items() if k not in derived.created[q]
        }
    for seed in range(2):
        _step(fresh, params, seed)
        _step(resumed, copies, seed)
    for p, q in zip(params, copies):
        for name, value in fresh.state[p].items():
            assert torch.equal(resumed.state[q][name], value), name
        assert torch.equal(p, q)


def test_only_state_that_the_first_update_creates_is_a_placeholder():
    for cls, kwargs, created in [
        (optim.SGD, {"momentum": 0.9}, {"momentum_buffer"}),
        (optim.SGD, {}, set()),  # no momentum: no state at all
        (optim.AdamW, {}, set()),
        (optim.ASGD, {}, set()),
        (optim.Muon, {}, set()),  # its buffer starts at zero before the update
    ]:
        opt, params = _fresh(cls, kwargs, {"two_d": True})
        derived = derive(opt, params, materialize=False)
        assert all(derived.created[p] == created for p in params), cls
        assert set(derived.states[params[0]]) >= created


class _ReadsValues(torch.optim.Optimizer):
    """A third-party optimizer without `_init_group` whose step reads a value (`.item()`)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st.setdefault("scale", torch.ones((), device=p.device))
                p.sub_(p.grad, alpha=group["lr"] * st["scale"].item())


def test_initial_state_that_meta_tensors_cannot_reveal_is_a_clear_error():
    params = _params()
    opt = _ReadsValues(params)
    with pytest.raises(
        RuntimeError,
        match=r"^cannot derive the initial state of _ReadsValues on meta tensors \(.*\.item\(\)"
        r".*\); step the optimizer once before taking its state dict$",
    ):
        derive(opt, params, materialize=True)
    assert not opt.state and all(p.grad is None for p in params)


def test_initial_state_follows_each_params_group_and_covers_only_the_params_asked():
    a, b, c = _params()
    opt = optim.Adam([{"params": [a, b], "amsgrad": True}, {"params": [c]}], lr=0.1)
    init = derive(opt, [b, c], materialize=True).states
    assert list(init) == [b, c]
    _step(opt, [a, b, c], seed=0)
    assert _layout(init[b]) == _layout(opt.state[b])
    assert _layout(init[c]) == _layout(opt.state[c])
    assert "max_exp_avg_sq" in init[b] and "max_exp_avg_sq" not in init[c]


def test_initial_state_of_nested_factored_state_matches_a_real_step():
    opt, params = _factored_after_steps(0, dtype=torch.bfloat16)
    init = derive(opt, params, materialize=True).states
    _step(opt, params, seed=0)
    for p in params:
        assert _layout(init[p]) == _layout(opt.state[p])
        assert _layout(init[p]["factors"]) == _layout(opt.state[p]["factors"])
        assert init[p]["note"] == "factored"
        assert not init[p]["factors"]["row"].any()


# -- materialize=False: shapes and types, no new full-size storage ------------------------------


def _assert_lazy(init: dict[torch.Tensor, dict[str, Any]], real: dict) -> None:
    """Each tensor of `init` carries the real state's shape; none owns new full-size memory."""
    for p, state in init.items():
        flat: dict[str, Any] = {}
        flatten_into(flat, "s", state)
        for key, value in flat.items():
            want = real[p]
            for name in key.split(".")[1:]:
                want = want[name]
            if not isinstance(value, torch.Tensor):
                assert value == want, key
                continue
            assert value.shape == want.shape, key
            if value.dim() == 0:
                assert value.dtype == want.dtype, key  # a real 0-d scalar is a few bytes
            elif value.device.type != "meta":
                assert value.untyped_storage().data_ptr() == p.untyped_storage().data_ptr(), key


def test_lazy_initial_state_allocates_no_full_size_tensors():
    for cls, kwargs in [(optim.AdamW, {}), (optim.Adam, {"amsgrad": True})]:
        opt, params = _fresh(cls, kwargs, {})
        lazy = derive(opt, params, materialize=False).states
        _step(opt, params, seed=0)
        _assert_lazy(lazy, opt.state)
    opt, params = _factored_after_steps(0)
    lazy = derive(opt, params, materialize=False).states
    assert all(lazy[p]["factors"]["row"].device.type == "meta" for p in params)
    assert all(lazy[p]["factors"]["row"].dtype == torch.float32 for p in params)
    _step(opt, params, seed=0)
    _assert_lazy(lazy, opt.state)


def test_lazy_full_shape_entry_carries_the_state_dtype():
    opt, params = _factored_after_steps(0, dtype=torch.bfloat16)
    lazy = derive(opt, params[:1], materialize=False).states
    assert lazy[params[0]]["momentum"].dtype == torch.float32


# -- DTensor parameters on 2 gloo ranks ---------------------------------------------------------


def _describe(value: Any) -> Any:
    if isinstance(value, DTensor):
        return ("DTensor", str(value.placements), tuple(value.to_local().shape), value.shape)
    if isinstance(value, torch.Tensor):
        return (type(value).__name__, value.device.type, tuple(value.shape), value.dtype)
    return value


def _sharded_initial_states() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Linear(7, 3)  # 3 rows over 2 ranks: 2 and 1
    fully_shard(model, mesh=mesh)
    opt = optim.AdamW(model.parameters(), lr=0.1)
    params = list(model.parameters())
    init = derive(opt, params, materialize=True).states
    lazy = derive(opt, params, materialize=False).states
    out: dict[str, Any] = {"params": {}, "init": {}, "lazy": {}, "real": {}, "zero": True}
    for name, p in model.named_parameters():
        out["params"][name] = _describe(p)
        out["init"][name] = {k: _describe(v) for k, v in init[p].items()}
        out["lazy"][name] = {k: _describe(v) for k, v in lazy[p].items()}
        out["zero"] &= all(not v.full_tensor().any() for v in init[p].values() if v.dim())
    model(torch.randn(4, 7)).square().sum().backward()
    opt.step()
    for name, p in model.named_parameters():
        out["real"][name] = {k: _describe(v) for k, v in opt.state[p].items()}
    return out


def test_sharded_params_get_dtensor_state_with_their_placements():
    ranks = run_ranks(2, _sharded_initial_states)
    assert [r["params"]["weight"][2] for r in ranks] == [(2, 7), (1, 7)]  # uneven shards
    for r in ranks:
        assert r["zero"]
        for name, param in r["params"].items():
            init, lazy = r["init"][name], r["lazy"][name]
            assert init == r["real"][name]
            assert init["exp_avg"] == init["exp_avg_sq"] == param  # placements and shapes
            assert lazy["exp_avg"] == param
            assert init["step"] == lazy["step"] == ("Tensor", "cpu", (), torch.float32)
