"""No value reaches an optimizer unchecked: `load_state_dict` refuses hyperparameters torch's
constructors would refuse, step counts that are not one number and state that is not finite,
before anything changes; a step refuses a hyperparameter set to a float that is not finite,
so no step writes NaN weights that its report calls applied."""

from __future__ import annotations

import pytest
import torch

from containers import LeanAdamW, OptimizersContainer, OptimizersInBackwardContainer
from tests.harness.dist import run_ranks
from tests.harness.helpers import assert_same, sharded_three_parts, three_parts, train


def _trained(cls: type = torch.optim.AdamW, **kwargs) -> tuple[list, OptimizersContainer]:
    parts = three_parts(0)
    opt = OptimizersContainer(parts, cls, {"lr": 1e-2, "fused": True, **kwargs})
    train(parts, opt, 2)
    return parts, opt


def _set(sd: dict, suffix: str, value) -> dict:
    """`sd` with every key ending in `suffix` set to `value`."""
    keys = [k for k in sd if k.endswith(suffix)]
    assert keys, suffix
    return {**sd, **dict.fromkeys(keys, value)}


@pytest.mark.parametrize(
    ("suffix", "value", "match"),
    [
        (".lr", "fast", r"lr = 'fast': expected a number, got str"),
        (".lr", -5.0, r"lr = -5.0: outside \[0, inf\)"),
        (".lr", float("nan"), r"lr = nan: not finite"),
        (".betas", (0.9, 1.5), r"betas = \(0.9, 1.5\): outside \[0, 1\)"),
        (".weight_decay", float("inf"), r"weight_decay = inf: not finite"),
    ],
)
def test_a_load_refuses_settings_torchs_optimizers_refuse_and_changes_nothing(suffix, value, match):
    _, opt = _trained()
    before = opt.state_dict()
    bad = _set(opt.state_dict(), suffix, value)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(bad)
    assert_same(opt.state_dict(), before)


def _one_rank_bad(what: str) -> str:
    """An FSDP2 job on each rank; rank 1 alone loads a dict with a bad `what` ("lr" -5 or
    a NaN moment): what each rank's `load_state_dict` raised."""
    import torch.distributed as dist

    parts = sharded_three_parts(0)
    opt = OptimizersContainer(parts, torch.optim.AdamW, {"lr": 1e-2})
    train(parts, opt, 2, rank=dist.get_rank())
    sd = opt.state_dict()
    if dist.get_rank() == 1:
        if what == "lr":
            sd = _set(sd, ".lr", -5.0)
        else:
            key = next(k for k in sd if k.endswith(".exp_avg_sq"))
            sd[key].to_local().view(-1)[0] = float("nan")
    try:
        opt.load_state_dict(sd)
    except ValueError as e:
        return str(e)
    return "loaded"


@pytest.mark.parametrize("what", ["lr", "moment"])
def test_a_bad_value_on_one_rank_is_refused_on_every_rank(what):
    """The ranks decide together: the one holding the bad value names it, the other says
    another rank's part was refused, and none is left waiting in a collective."""
    ours, theirs = run_ranks(2, _one_rank_bad, what)
    assert (
        theirs.startswith("optimizer state dict: ")
        and ("lr = -5.0: outside [0, inf)" if what == "lr" else "non-finite values in [state.")
        in theirs
    ), theirs
    assert ours == (
        "optimizer state dict: another rank's part was refused (non-finite values or settings "
        "torch's optimizers refuse: that rank's error names them); nothing was loaded"
    ), ours


def test_a_load_refuses_a_step_count_that_is_not_one_number():
    _, opt = _trained()
    bad = _set(opt.state_dict(), ".step", torch.zeros(2))
    with pytest.raises(ValueError, match=r"\.step: want one number, got shape \(2,\)"):
        opt.load_state_dict(bad)


@pytest.mark.parametrize("moments", ["float32", "8bit"])
def test_a_load_refuses_moments_that_are_not_finite_naming_them(moments):
    cls = torch.optim.AdamW if moments == "float32" else LeanAdamW
    kwargs = {} if moments == "float32" else {"moment_dtype": moments}
    _, opt = _trained(cls, **kwargs)
    before = opt.state_dict()
    sd = opt.state_dict()
    key = next(k for k in sd if ".exp_avg_sq" in k and sd[k].is_floating_point())
    poisoned = sd[key].clone()
    poisoned.view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match=rf"non-finite values in .*{key}"):
        opt.load_state_dict({**sd, key: poisoned})
    assert_same(opt.state_dict(), before)


@pytest.mark.parametrize("container", [OptimizersContainer, OptimizersInBackwardContainer])
def test_a_step_refuses_a_learning_rate_that_is_not_finite_and_writes_nothing(container):
    parts = three_parts(0)
    opt = container(parts, torch.optim.AdamW, {"lr": 1e-2})
    train(parts, opt, 1)
    weights = [p.detach().clone() for part in parts for p in part.parameters()]
    opt.optimizers[0].param_groups[0]["lr"] = float("nan")  # a scheduler gone wrong
    with pytest.raises(ValueError, match=r"AdamW param group 0: lr = nan"):
        train(parts, opt, 1, start=1)
    after = [p.detach() for part in parts for p in part.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(weights, after))


def test_every_step_inside_backward_checks_its_settings_after_steps_applied_by_step():
    """Units that apply in `step()` (gradients set outside backward) and a refusal raised
    inside backward leave the next step's units checked all the same."""
    parts = three_parts(0)
    opt = OptimizersInBackwardContainer(parts, torch.optim.AdamW, {"lr": 1e-2})
    for part in parts:
        for p in part.parameters():
            p.grad = torch.randn_like(p)
    opt.step()  # every unit applies here, in `finish`
    opt.zero_grad()
    group = opt.optimizers[0].param_groups[0]
    group["lr"] = float("nan")
    for _ in range(2):  # the second after a refusal inside backward
        with pytest.raises(ValueError, match=r"lr = nan"):
            train(parts, opt, 1, start=1)
    group["lr"] = 1e-2
    train(parts, opt, 1, start=2)
    assert all(p.isfinite().all() for part in parts for p in part.parameters())
