"""The default OptimizersContainer: parity, contract, flat state dict, DCP resharding."""

from __future__ import annotations

import copy
import importlib.util
import logging
import math
import re
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

import containers.container as decision_module
from components.checkpoint.resume import ConfigSettings
from containers import (
    LeanAdamW,
    MixedPrecisionOptimizersContainer,
    OptimizersContainer,
    OptimizersInBackwardContainer,
    ParamGroupRule,
    Precision,
)
from tests.harness import optim_db
from tests.harness.dist import run_ranks
from tests.harness.helpers import (
    assert_same,
    assert_skipped_alike,
    batch,
    forward,
    full,
    poisoned_run,
    sharded_three_parts,
    three_parts,
    train,
)

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)

CASES = [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}),
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": True}),
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01, "foreach": False}),
    (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True, "fused": True}),
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "foreach": False}),
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "fused": True}),
]


def _torch_flat(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
    out: dict = {}
    for part, opt in zip(parts, optimizers):
        out.update(get_optimizer_state_dict(part, opt, options=FLAT))
    return out


NO_DECAY = r"\.bias$|norm"


def _plain_adamw(parts: list[nn.Module], lr: float) -> list[torch.optim.Optimizer]:
    """Plain torch AdamW per part with the groups that the NO_DECAY rule forms."""
    optimizers = []
    for part in parts:
        named = list(part.named_parameters())
        rest = [p for n, p in named if not re.search(NO_DECAY, n)]
        no_decay = [p for n, p in named if re.search(NO_DECAY, n)]
        groups = [{"params": rest}, {"params": no_decay, "weight_decay": 0.0}]
        optimizers.append(torch.optim.AdamW([g for g in groups if g["params"]], lr=lr))
    return optimizers


@pytest.mark.parametrize(("cls", "kwargs"), CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_bitwise_parity_with_torch_optimizer_over_three_parts(cls, kwargs):
    parts = three_parts()
    ref_parts = copy.deepcopy(parts)
    container = OptimizersContainer(parts, cls, kwargs)
    ref = cls([p for m in ref_parts for p in m.parameters()], **kwargs)
    assert len(container) == 3
    train(parts, container, 10)
    train(ref_parts, ref, 10)
    for m, r in zip(parts, ref_parts):
        for a, b in zip(m.parameters(), r.parameters()):
            assert torch.equal(a, b)


def test_state_dict_is_torchs_flat_format_and_cross_loads_both_ways():
    parts = three_parts()
    rules = [ParamGroupRule(NO_DECAY, {"weight_decay": 0.0})]
    container = OptimizersContainer(parts, torch.optim.AdamW, {"lr": 1e-2}, param_groups=rules)
    train(parts, container, 3)
    ours = container.state_dict()
    assert_same(ours, _torch_flat(parts, container.optimizers))
    assert ours["param_groups.norm.weight.weight_decay"] == 0.0
    assert ours["param_groups.mid.weight.weight_decay"] == 0.01

    # container -> plain torch optimizers, through torch's own API
    plain_parts = copy.deepcopy(parts)
    plain = _plain_adamw(plain_parts, lr=0.5)
    for part, opt in zip(plain_parts, plain):
        set_optimizer_state_dict(part, opt, ours, options=FLAT)
    train(parts, container, 2, start=3)
    for step in range(3, 5):
        for opt in plain:
            opt.zero_grad()
        forward(plain_parts, batch(step)).square().mean().backward()
        for opt in plain:
            opt.step()
    assert_same(container.state_dict(), _torch_flat(plain_parts, plain))

    # plain torch optimizers -> container (built with the same settings: its own are kept)
    fresh = OptimizersContainer(
        copy.deepcopy(plain_parts), torch.optim.AdamW, {"lr": 1e-2}, param_groups=rules
    )
    fresh.load_state_dict(_torch_flat(plain_parts, plain))
    assert_same(fresh.state_dict(), container.state_dict())


def test_fresh_state_dict_leaves_state_alone_and_covers_every_param():
    parts = three_parts()
    ref_parts = copy.deepcopy(parts)
    container = OptimizersContainer(parts, torch.optim.AdamW, {"lr": 1e-2, "fused": True})
    for _ in range(2):
        sd = container.state_dict()
    assert not dict(container.state), "state_dict() must not initialize the optimizer"
    trainable = [n for m in parts for n, p in m.named_parameters()]
    assert sorted(
        k[len("state.") : -len(".exp_avg")] for k in sd if k.endswith(".exp_avg")
    ) == sorted(trainable)
    assert all(sd[f"state.{n}.step"].item() == 0 for n in trainable)
    ref = torch.optim.AdamW([p for m in ref_parts for p in m.parameters()], lr=1e-2, fused=True)
    train(parts, container, 10)
    train(ref_parts, ref, 10)
    for a, b in zip(
        (p for m in parts for p in m.parameters()), (p for m in ref_parts for p in m.parameters())
    ):
        assert torch.equal(a, b)


def test_loading_the_fresh_template_is_the_same_as_starting_fresh():
    parts = three_parts()
    ref_parts = copy.deepcopy(parts)
    a = OptimizersContainer(parts, torch.optim.AdamW, {"lr": 1e-2})
    b = OptimizersContainer(ref_parts, torch.optim.AdamW, {"lr": 1e-2})
    a.load_state_dict(b.state_dict())
    train(parts, a, 5)
    train(ref_parts, b, 5)
    assert_same(a.state_dict(), b.state_dict())


def test_round_trip_is_exact_and_resumes_bitwise():
    parts = three_parts()
    container = OptimizersContainer(parts, torch.optim.Adam, {"lr": 1e-2, "fused": True})
    train(parts, container, 4)
    snapshot = {k: full(v) for k, v in container.state_dict().items()}
    weights = copy.deepcopy([m.state_dict() for m in parts])
    train(parts, container, 3, start=4)
    after = {k: full(v) for k, v in container.state_dict().items()}
    container.load_state_dict(snapshot)
    assert_same(container.state_dict(), snapshot)
    for m, w in zip(parts, weights):
        m.load_state_dict(w)
    train(parts, container, 3, start=4)
    assert_same(container.state_dict(), after)


def _state_copy(container: OptimizersContainer) -> dict:
    return {k: full(v) for k, v in container.state_dict().items()}


def test_bad_state_dict_raises_listing_keys_and_changes_nothing():
    parts = three_parts()
    container = OptimizersContainer(parts, torch.optim.AdamW, {"lr": 1e-2})
    train(parts, container, 2)
    before = _state_copy(container)
    good = container.state_dict()

    missing = {k: v for k, v in good.items() if k != "state.mid.weight.exp_avg_sq"}
    with pytest.raises(ValueError, match=r"missing keys \[state\.mid\.weight\.exp_avg_sq\]"):
        container.load_state_dict(missing)
    extra = {**good, "state.other.weight.exp_avg": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"unexpected keys \[state\.other\.weight\.exp_avg\]"):
        container.load_state_dict(extra)
    wrong = {**good, "state.mid.weight.exp_avg": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match=r"state\.mid\.weight\.exp_avg: want shape \(9, 7\)"):
        container.load_state_dict(wrong)
    unflat = torch.optim.AdamW(parts[0].parameters()).state_dict()
    with pytest.raises(ValueError, match="unflattened"):
        container.load_state_dict(unflat)
    sgd = OptimizersContainer(copy.deepcopy(parts), torch.optim.SGD, {"lr": 1, "momentum": 0.9})
    with pytest.raises(
        ValueError,
        match=r"^the checkpoint's optimizer state does not carry over to AdamW: it keeps "
        r"\[momentum_buffer\] per parameter \(e\.g\. 'embed\.weight'\), AdamW keeps "
        r"\[exp_avg, exp_avg_sq, step\]; load it with an optimizer whose state has the "
        r"checkpoint's names \(the one that wrote it, or Adam <-> AdamW\), or start without "
        r"this checkpoint$",
    ):
        container.load_state_dict(sgd.state_dict())
    assert_same(_state_copy(container), before)


def test_a_load_takes_state_and_hyperparameters_as_torch_and_the_trainer_rule_puts_config_back(
    caplog,
):
    parts = three_parts()
    rules = [ParamGroupRule(NO_DECAY, {"weight_decay": 0.0})]
    old = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    writer = OptimizersContainer(parts, torch.optim.AdamW, old, param_groups=rules)
    train(parts, writer, 2)
    saved = _state_copy(writer)

    # torch's contract: Adam built with other settings loads AdamW's state dict as an
    # AdamW (decoupled decay) with the dict's lr, betas, eps, weight decays: what torch does.
    new = {"lr": 1e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.01, "foreach": False}
    new_parts = copy.deepcopy(parts)
    reader = OptimizersContainer(new_parts, torch.optim.Adam, new, param_groups=rules)
    config = ConfigSettings(reader)  # the trainer's snapshot of its config
    settings = {k: v for k, v in reader.param_groups[0].items() if k != "params"}
    reader.load_state_dict(saved)
    loaded = {k: v for k, v in reader.param_groups[0].items() if k != "params"}
    assert loaded == settings | {k: old[k] for k in old} | {"decoupled_weight_decay": True}
    assert [g["weight_decay"] for g in reader.param_groups] == [0.1, 0.0] * 3
    assert loaded["foreach"] is False  # kernel choices stay the container's

    # The trainer's rule (components.checkpoint.resume): the config wins, said in one line.
    with caplog.at_level(logging.INFO, logger="components.checkpoint.resume"):
        config.restore()
    assert [r.getMessage() for r in caplog.records if "resume:" in r.getMessage()] == [
        "resume: from the config, not the checkpoint: lr 0.01 -> 0.001, betas (0.9, 0.95) -> "
        "(0.8, 0.99), eps 1e-08 -> 1e-06, weight_decay 0.1 -> 0.01, optimizer AdamW -> Adam"
    ]

    # The next steps are torch's Adam at the config's settings, from the saved moments.
    ref_parts = copy.deepcopy(parts)
    named = [(n, p) for m in ref_parts for n, p in m.named_parameters()]
    ref = torch.optim.Adam([p for _, p in named], **new)
    for name, p in named:
        ref.state[p] = {
            k: saved[f"state.{name}.{k}"].clone() for k in ("step", "exp_avg", "exp_avg_sq")
        }
    ref.param_groups[0]["params"] = [p for n, p in named if not re.search(NO_DECAY, n)]
    ref.add_param_group(
        {"params": [p for n, p in named if re.search(NO_DECAY, n)], "weight_decay": 0.0}
    )
    train(new_parts, reader, 2, start=2)
    train(ref_parts, ref, 2, start=2)
    for m, r in zip(new_parts, ref_parts):
        assert all(torch.equal(a, b) for a, b in zip(m.parameters(), r.parameters()))

    # Nothing changed since: nothing to say.
    caplog.clear()
    reader.load_state_dict(_state_copy(reader))
    with caplog.at_level(logging.INFO, logger="components.checkpoint.resume"):
        assert config.restore() == []


def test_a_torchtitan_format_optimizer_state_dict_loads_with_its_lr():
    # torchtitan flattens with torch's own flatten_optimizer_state_dict: the same keys.
    parts = three_parts()
    plain = [torch.optim.AdamW(part.parameters(), lr=7e-4) for part in parts]  # one per part
    forward(parts, batch(0)).square().mean().backward()
    for opt in plain:
        opt.step()
    flat = _torch_flat(parts, plain)
    container = OptimizersContainer(copy.deepcopy(parts), torch.optim.AdamW, {"lr": 1e-2})
    container.load_state_dict(flat)
    assert {g["lr"] for g in container.param_groups} == {7e-4}
    assert_same(container.state_dict(), flat)


def test_a_failed_load_leaves_the_hyperparameters_as_they_were():
    parts = three_parts()
    container = OptimizersContainer(parts, torch.optim.AdamW, {"lr": 1e-2})
    train(parts, container, 1)
    saved = _state_copy(container)
    saved = {k: (1e-5 if k.endswith(".lr") else v) for k, v in saved.items()}
    saved["state.head.weight.exp_avg"] = torch.zeros(3, 3)  # the last part's: wrong shape
    before = [dict(g) for g in container.param_groups]
    with pytest.raises(ValueError, match="mismatched"):
        container.load_state_dict(saved)
    assert [dict(g) for g in container.param_groups] == before


def _parts_for(cls: type) -> list[nn.Module]:
    """A small model that `cls` can step: 2-D weights for Muon, a sparse embedding for
    SparseAdam, else `three_parts`."""
    torch.manual_seed(0)
    if cls is torch.optim.Muon:
        return [
            nn.Sequential(OrderedDict(embed=nn.Linear(10, 7, bias=False), act=nn.Tanh())),
            nn.Sequential(OrderedDict(head=nn.Linear(7, 5, bias=False))),
        ]
    if cls is torch.optim.SparseAdam:
        return [nn.Sequential(OrderedDict(embed=nn.Embedding(10, 3, sparse=True)))]
    return three_parts()


def _train_any(parts: list[nn.Module], opt: OptimizersContainer, steps: int, start: int) -> None:
    for step in range(start, start + steps):
        opt.zero_grad()
        if isinstance(parts[0][0], nn.Embedding):
            ids = torch.randint(0, 10, (6,), generator=torch.Generator().manual_seed(step))
            parts[0](ids).square().mean().backward()
        else:
            forward(parts, batch(step)).square().mean().backward()
        opt.step()


def _weights_equal(a: list[nn.Module], b: list[nn.Module]) -> bool:
    pairs = zip((p for m in a for p in m.parameters()), (p for m in b for p in m.parameters()))
    return all(torch.equal(x, y) for x, y in pairs)


@pytest.mark.parametrize(
    ("cls", "desc", "kwargs"),
    optim_db.cases(),
    ids=[f"{c.__name__}-{d}" for c, d, _ in optim_db.cases()],
)
def test_a_fresh_container_resumes_every_torch_optimizer(cls, desc, kwargs):
    def build(parts: list[nn.Module]) -> OptimizersContainer:
        return OptimizersContainer(parts, cls, optim_db.kwargs_of(kwargs))

    # A checkpoint of a run that stepped: the resumed run goes on bitwise.
    run_parts = _parts_for(cls)
    run = build(run_parts)
    _train_any(run_parts, run, 2, start=0)
    resumed_parts = copy.deepcopy(run_parts)
    resumed = build(resumed_parts)
    resumed.load_state_dict(_state_copy(run))
    # A checkpoint of a container that never stepped: loading it is starting fresh.
    fresh_parts = _parts_for(cls)
    fresh = build(fresh_parts)
    from_template_parts = copy.deepcopy(fresh_parts)
    from_template = build(from_template_parts)
    from_template.load_state_dict(_state_copy(build(copy.deepcopy(fresh_parts))))

    for parts, opt, start in [
        (run_parts, run, 2),
        (resumed_parts, resumed, 2),
        (fresh_parts, fresh, 0),
        (from_template_parts, from_template, 0),
    ]:
        _train_any(parts, opt, 2, start)
    assert_same(_state_copy(resumed), _state_copy(run))
    assert _weights_equal(resumed_parts, run_parts)
    assert_same(_state_copy(from_template), _state_copy(fresh))
    assert _weights_equal(from_template_parts, fresh_parts)


@pytest.mark.skipif(
    importlib.util.find_spec("expecttest") is None,
    reason="reading torch's optim_db needs expecttest (pip install -e '.[test]')",
)
@pytest.mark.slow
def test_the_optimizer_table_is_torchs_own():
    theirs = optim_db.read_torch_optim_db()
    assert set(theirs) - set(optim_db.CASES) == optim_db.LEFT_OUT
    assert {k: v for k, v in theirs.items() if k not in optim_db.LEFT_OUT} == optim_db.CASES


def test_implementation_flags_are_kept_on_load():
    parts = three_parts()
    fused = OptimizersContainer(parts, torch.optim.AdamW, {"lr": 1e-2, "fused": True})
    train(parts, fused, 1)
    looped = OptimizersContainer(
        copy.deepcopy(parts), torch.optim.AdamW, {"lr": 1e-2, "foreach": False}
    )
    looped.load_state_dict(fused.state_dict())
    assert all(g["fused"] in (None, False) and g["foreach"] is False for g in looped.param_groups)


def test_param_groups_are_live_for_schedulers_and_users():
    parts = three_parts()
    container = OptimizersContainer(parts, torch.optim.SGD, {"lr": 1.0})
    sched = torch.optim.lr_scheduler.LambdaLR(container, lambda step: 0.5**step)
    train(parts, container, 1)
    sched.step()
    assert [g["lr"] for o in container for g in o.param_groups] == [0.5, 0.5, 0.5]

    # A user write to a group must change the real update: lr 0 freezes the weights.
    for group in container.param_groups:
        group["lr"] = 0.0
    before = [p.detach().clone() for m in parts for p in m.parameters()]
    train(parts, container, 1, start=1)
    assert all(
        torch.equal(a, b) for a, b in zip(before, (p for m in parts for p in m.parameters()))
    )


def test_first_match_rules_are_ordered_as_torchtitans_and_disjoint_ones_refuse_overlaps():
    """`first_match`: a parameter joins the first rule that matches, a catch-all `.*` last
    takes the rest; the default (disjoint rules) refuses a parameter two rules match, and a
    rule that earlier ones leave nothing is refused under either."""
    rules = [
        ParamGroupRule(r"^embed\.weight$", {"lr": 1e-3}),
        ParamGroupRule(r"weight", {"lr": 2e-3}),
        ParamGroupRule(r".*", {"weight_decay": 0.0}),
    ]
    parts = three_parts()
    container = OptimizersContainer(
        parts, torch.optim.AdamW, {"lr": 1e-2}, param_groups=rules, first_match=True
    )
    names = {p: f"{i}.{n}" for i, part in enumerate(parts) for n, p in part.named_parameters()}
    got = {
        names[p]: (g["lr"], g["weight_decay"]) for g in container.param_groups for p in g["params"]
    }
    assert got["0.embed.weight"] == (1e-3, 0.01)
    assert all(
        v == (2e-3, 0.01) for k, v in got.items() if k.endswith("weight") and "embed" not in k
    )
    assert all(v == (1e-2, 0.0) for k, v in got.items() if k.endswith("bias"))
    assert len(got) == sum(1 for part in parts for _ in part.parameters())
    with pytest.raises(ValueError, match=r"'embed.weight' matches param group patterns .*disjoint"):
        OptimizersContainer(three_parts(), torch.optim.AdamW, {"lr": 1e-2}, param_groups=rules)
    shadowed = [*rules, ParamGroupRule("bias", {"lr": 0.0})]
    with pytest.raises(ValueError, match=r"\['bias'\] match no trainable parameter that an earl"):
        OptimizersContainer(
            three_parts(), torch.optim.AdamW, {"lr": 1e-2}, param_groups=shadowed, first_match=True
        )


def test_a_group_takes_unset_keys_from_the_container_or_torch_never_from_another_group():
    # Every parameter matches a rule, so no default group comes first in any unit.
    rules = [
        ParamGroupRule("bias", {"weight_decay": 0.0}),
        ParamGroupRule("weight", {"lr": 1e-3}),
    ]
    for kwargs, wd in (({"lr": 1e-2}, 0.01), ({"lr": 1e-2, "weight_decay": 0.2}, 0.2)):
        container = OptimizersContainer(
            three_parts(), torch.optim.AdamW, kwargs, param_groups=rules
        )
        weights = [g for g in container.param_groups if g["lr"] == 1e-3]
        biases = [g for g in container.param_groups if g["lr"] == 1e-2]
        assert len(weights) == len(biases) == 3
        assert all(g["weight_decay"] == wd for g in weights)  # torch's 0.01, or the container's
        assert all(g["weight_decay"] == 0.0 for g in biases)
        assert all(o.defaults["weight_decay"] == wd for o in container)


def test_step_hooks_fire_once_per_step_and_closure_runs_once():
    parts = three_parts()
    container = OptimizersContainer(parts, torch.optim.AdamW, {"lr": 1e-2})
    calls: list[str] = []
    pre = container.register_step_pre_hook(lambda opt, a, k: calls.append("pre"))
    container.register_step_post_hook(lambda opt, a, k: calls.append("post"))
    train(parts, container, 3)
    assert calls == ["pre", "post"] * 3
    pre.remove()

    def closure():
        calls.append("closure")
        container.zero_grad()
        loss = forward(parts, batch(0)).square().mean()
        loss.backward()
        return loss

    calls.clear()
    loss = container.step(closure)
    assert calls == ["closure", "post"] and loss.dim() == 0


@pytest.mark.parametrize("timing", ["after", "in_backward"])
def test_global_step_hooks_see_the_container_once_per_step_in_torchs_order(timing):
    parts, ref_parts = three_parts(), three_parts()
    cls = OptimizersInBackwardContainer if timing == "in_backward" else OptimizersContainer
    container = cls(parts, torch.optim.AdamW, {"lr": 1e-2})
    ref = torch.optim.AdamW([p for m in ref_parts for p in m.parameters()], lr=1e-2)
    inner: list[int] = []
    container.optimizers[0].register_step_pre_hook(lambda *a: inner.append(1))  # still fires
    seen: dict[object, list[str]] = {container: [], ref: []}
    handles = [
        register_optimizer_step_pre_hook(lambda opt, a, k: seen[opt].append("global pre")),
        register_optimizer_step_post_hook(lambda opt, a, k: seen[opt].append("global post")),
    ]
    for opt in (container, ref):
        opt.register_step_pre_hook(lambda o, a, k: seen[o].append("pre"))
        opt.register_step_post_hook(lambda o, a, k: seen[o].append("post"))
    try:
        train(parts, container, 3)
        train(ref_parts, ref, 3)
    finally:
        for handle in handles:
            handle.remove()
    # What one torch AdamW shows its hooks, and nothing of the inner optimizers (a KeyError).
    assert seen[container] == seen[ref] == ["global pre", "pre", "post", "global post"] * 3
    assert len(inner) == 3 * (len(container.units) // 3 if timing == "in_backward" else 1)


def test_one_cycle_lr_cycles_the_inner_betas_as_on_one_torch_adamw():
    parts, ref_parts = three_parts(), three_parts()
    container = OptimizersContainer(parts, torch.optim.AdamW, {"lr": 1e-2})
    ref = torch.optim.AdamW([p for m in ref_parts for p in m.parameters()], lr=1e-2)
    assert {"betas", "eps", "weight_decay", "amsgrad"} <= container.defaults.keys()
    cycles = [
        torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=6)
        for opt in (container, ref)
    ]
    beta1s = set()
    for step in range(5):
        for model, opt, sched in ((parts, container, cycles[0]), (ref_parts, ref, cycles[1])):
            train(model, opt, 1, start=step)
            sched.step()
        want = [(g["lr"], g["betas"]) for g in ref.param_groups]
        assert {(g["lr"], g["betas"]) for g in container.param_groups} == set(want)
        beta1s.add(want[0][1][0])
    assert len(beta1s) > 2  # the momentum did cycle
    assert _weights_equal(parts, ref_parts)


def test_frozen_params_are_skipped_and_iter_len_state_work():
    parts = three_parts()
    parts[1].requires_grad_(False)
    container = OptimizersContainer(parts, torch.optim.AdamW, {"lr": 1e-2})
    assert len(container) == 2 and [type(o) for o in container] == [torch.optim.AdamW] * 2
    train(parts, container, 1)
    assert len(container.state) == 4
    assert not any(k.startswith("state.mid.") for k in container.state_dict())
    # A lookup finds the owner's state and leaves the other optimizers' defaultdicts alone.
    first, last = container.optimizers
    head = last.param_groups[0]["params"][0]
    assert container.state[head] is last.state[head] and head not in first.state
    with pytest.raises(KeyError):
        container.state[parts[1].mid.weight]  # frozen: nobody's
    first.state_dict()  # torch's own, which a foreign empty entry would break


def test_rules_can_ask_for_another_optimizer():
    parts = three_parts()
    rule = ParamGroupRule("head", {"lr": 0.1}, torch.optim.SGD, {"lr": 0.5, "momentum": 0.9})
    container = OptimizersContainer(parts, torch.optim.AdamW, {"lr": 1e-2}, param_groups=[rule])
    assert [type(o).__name__ for o in container] == ["AdamW", "AdamW", "SGD"]
    assert container.optimizers[2].param_groups[0]["lr"] == 0.1
    train(parts, container, 2)
    sd = container.state_dict()
    assert "state.head.weight.momentum_buffer" in sd and "state.mid.weight.exp_avg" in sd


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: OptimizersContainer([], torch.optim.SGD, {}), "non-empty list"),
        (
            lambda p: OptimizersContainer([p[0], p[0]], torch.optim.SGD, {}),
            "owned by exactly one part",
        ),
        (
            lambda p: OptimizersContainer(
                p, torch.optim.SGD, {}, param_groups=[ParamGroupRule("nothing")]
            ),
            r"\['nothing'\] match no trainable parameter",
        ),
        (
            lambda p: OptimizersContainer(
                p, torch.optim.SGD, {}, param_groups=[ParamGroupRule("bias"), ParamGroupRule("mid")]
            ),
            "'mid.bias' matches param group patterns",
        ),
        (
            lambda p: OptimizersContainer(
                p, torch.optim.SGD, {}, param_groups=[ParamGroupRule("(")]
            ),
            "is not a regex",
        ),
        (
            lambda p: OptimizersContainer([nn.Sequential(p[0]), p[0]], torch.optim.SGD, {}),
            "owned by exactly one part",
        ),
        (lambda p: OptimizersContainer(p, torch.optim.SGD, {"lr": -1.0}), "Invalid learning rate"),
    ],
)
def test_bad_construction_is_a_clear_error(make, match):
    with pytest.raises(ValueError, match=match):
        make(three_parts())


def test_add_param_group_is_refused():
    container = OptimizersContainer(three_parts(), torch.optim.SGD, {"lr": 0.1})
    with pytest.raises(NotImplementedError, match="build a new container"):
        container.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})


# -- DCP on FSDP2: save at 4 ranks, load at 1, 2 and 3 --------------------------------------


def _sharded_container(seed: int, lr: float) -> tuple[list[nn.Module], OptimizersContainer]:
    parts = sharded_three_parts(seed)
    rules = [ParamGroupRule(r"bias|norm", {"weight_decay": 0.0})]
    return parts, OptimizersContainer(
        parts, torch.optim.AdamW, {"lr": lr, "fused": True}, param_groups=rules
    )


def _save_sharded(path: str) -> dict:
    parts, container = _sharded_container(seed=0, lr=1e-2)
    train(parts, container, 3, rank=dist.get_rank())
    sd = container.state_dict()
    assert any(isinstance(v, torch.distributed.tensor.DTensor) for v in sd.values())
    dcp.save({"optim": container}, checkpoint_id=path)
    assert_same(sd, _torch_flat(parts, container.optimizers))
    return {k: full(v) for k, v in sd.items()}


def _load_sharded(path: str) -> dict:
    _, container = _sharded_container(seed=1, lr=5.0)
    dcp.load({"optim": container}, checkpoint_id=path)
    return {k: full(v) for k, v in container.state_dict().items()}


def test_dcp_saved_on_4_fsdp2_ranks_loads_identically_on_1_2_and_3(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(4, _save_sharded, path)[0]
    assert saved["state.embed.weight.exp_avg"].shape == (7, 10)

    parts = three_parts(seed=1)  # one process, no process group, plain tensors
    rules = [ParamGroupRule(r"bias|norm", {"weight_decay": 0.0})]
    single = OptimizersContainer(
        parts, torch.optim.AdamW, {"lr": 5.0, "fused": True}, param_groups=rules
    )
    dcp.load({"optim": single}, checkpoint_id=path, no_dist=True)
    assert_same(single.state_dict(), saved)  # the saved lr 1e-2 too, as torch loads it

    for world_size in (2, 3):
        assert_same(run_ranks(world_size, _load_sharded, path)[0], saved)


# -- non-finite steps are skipped -----------------------------------------------------------


def _container(kind: str, parts: list[nn.Module]) -> OptimizersContainer:
    kwargs = {"lr": 1e-2}
    if kind.endswith("_kernels"):  # fused, the skip left to the kernels as on CUDA
        decision_module.KERNEL_SKIP_DEVICES = frozenset({"cuda", "cpu"})  # (this rank's)
        kind, kwargs = kind.removesuffix("_kernels"), {**kwargs, "fused": True}
    if kind.startswith("mixed_precision"):  # (its default max_norm 0: the norm measured)
        max_norm = 1.0 if kind.endswith("clipped") else 0.0
        return MixedPrecisionOptimizersContainer(
            parts, torch.optim.AdamW, kwargs, max_norm=max_norm
        )
    if kind == "in_backward":
        return OptimizersInBackwardContainer(parts, torch.optim.AdamW, kwargs)
    max_norm = None if kind == "default_unclipped" else 1.0  # unclipped: the check, no norm
    return OptimizersContainer(parts, torch.optim.AdamW, kwargs, max_norm=max_norm)


def _skip_run(kind: str, poison_step: int | None, drop_step: int | None) -> dict:
    """Six steps on FSDP2 ranks; at `poison_step` rank 1's loss is NaN, at `drop_step` the
    batch is drawn but never used (the run without that step's update)."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parts = three_parts()
    for part in parts:
        if kind.startswith("mixed_precision"):
            part.to(torch.bfloat16)
        fully_shard(part, mesh=mesh)
    opt = _container(kind, parts)
    per_unit = kind.startswith("in_backward")
    assert opt.leaves_skip_to_kernels(opt.optimizers, per_unit) is kind.endswith("_kernels")
    reports = []
    for step in range(6):
        x = batch(step, rank)
        if step == drop_step:
            continue
        opt.zero_grad()
        loss = forward(parts, x.to(parts[0].embed.weight.dtype)).float().square().mean()
        if step == poison_step and rank == 1:
            loss = loss * torch.tensor(float("nan"))
        opt.backward(loss)
        opt.step()
        reports.append(opt.last_report)
    state = {k: full(v) for k, v in opt.state_dict().items()}
    params = {k: full(v) for part in parts for k, v in part.state_dict().items()}
    return {"reports": reports, "state": state, "params": params}


def _skip_pair(kind: str) -> tuple[dict, dict]:
    return _skip_run(kind, poison_step=2, drop_step=None), _skip_run(kind, None, drop_step=2)


@pytest.mark.parametrize(
    "kind",
    [
        "default",
        "default_kernels",
        "default_unclipped",
        "default_unclipped_kernels",
        "in_backward",
        "in_backward_kernels",
        "mixed_precision",
        "mixed_precision_kernels",
        "mixed_precision_clipped_kernels",
    ],
)
def test_a_nan_loss_on_one_rank_skips_the_step_everywhere_and_training_goes_on_bitwise(kind):
    for poisoned, dropped in run_ranks(2, _skip_pair, kind):
        skipped = poisoned["reports"].pop(2)
        assert not skipped.committed and skipped.nonfinite, skipped
        assert all(r.committed for r in poisoned["reports"] + dropped["reports"])
        assert_same(poisoned["params"], dropped["params"])
        assert_same(poisoned["state"], dropped["state"])
        assert all(
            v.isfinite().all() for v in poisoned["state"].values() if isinstance(v, torch.Tensor)
        )


class _DecidesOnHost(Precision):
    @property
    def features(self) -> dict[str, str]:
        return {"host_skip": "_DecidesOnHost"}


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}),
        (LeanAdamW, {"lr": 1e-2, "moment_dtype": "bfloat16"}),
        pytest.param(
            LeanAdamW,
            {"lr": 1e-2, "moment_dtype": "bfloat16", "compiled": True},
            marks=pytest.mark.slow,  # an inductor compile
        ),
    ],
    ids=["AdamW", "LeanAdamW-bf16", "LeanAdamW-bf16-compiled"],
)
@pytest.mark.parametrize("timing", ["after", "in_backward"])
def test_a_skip_left_to_the_fused_kernels_is_the_host_decided_skip_bitwise(
    cls, kwargs, timing, monkeypatch
):
    """Without a clip, fused groups skip in the kernel on a flag (no host sync; in backward,
    one per unit); the report reads the flags when asked. Deciding on the host first gives
    the same weights, state and reports: a skip on the very first step, a whole step's and
    (in backward) one unit's. (CUDA's path, taken here on a CPU.)"""
    container = OptimizersInBackwardContainer if timing == "in_backward" else OptimizersContainer
    assert not container(three_parts(), cls, kwargs).leaves_skip_to_kernels([])  # a CPU's
    monkeypatch.setattr(decision_module, "KERNEL_SKIP_DEVICES", frozenset({"cuda", "cpu"}))
    runs = []
    for on_host in (False, True):
        parts = three_parts()
        precision = _DecidesOnHost() if on_host else None
        opt = container(parts, cls, kwargs, precision=precision)
        per_unit = timing == "in_backward"
        assert opt.leaves_skip_to_kernels(opt.optimizers, per_unit=per_unit) is not on_host
        runs.append(poisoned_run(parts, opt))
    assert_skipped_alike(*runs, per_unit=timing == "in_backward")


def test_a_clipped_step_left_to_the_kernels_is_torchs_clip_by_the_fp64_norm_bitwise(
    monkeypatch,
):
    """With a clip, fused groups skip in the kernel on the norm itself (its squares summed in
    fp64, finite iff every gradient is), no host decision: the weights and state are torch's
    fused AdamW after torch's clip by that norm, bit for bit; a NaN skips the step, the
    report (read when asked) says so with the norm; a finite 1e20, whose fp32 square would
    overflow, is clipped and applied. (CUDA's path, taken here on a CPU.)"""
    monkeypatch.setattr(decision_module, "KERNEL_SKIP_DEVICES", frozenset({"cuda", "cpu"}))
    kwargs = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}
    parts, ref_parts = three_parts(), three_parts()
    opt = OptimizersContainer(parts, torch.optim.AdamW, kwargs, max_norm=1.0)
    assert opt.leaves_skip_to_kernels(opt.optimizers)
    ref_params = [p for part in ref_parts for p in part.parameters()]
    ref = torch.optim.AdamW(ref_params, **kwargs)
    norms = []
    for step in range(4):
        for each in (parts, ref_parts):
            for part in each:
                part.zero_grad()
            forward(each, batch(step)).square().mean().backward()
            grad = each[1].mid.weight.grad
            grad[0, 0] = {1: float("nan"), 2: 1e20}.get(step, grad[0, 0])
        opt.step()
        squares = [torch.linalg.vector_norm(p.grad, dtype=torch.float64) for p in ref_params]
        norms.append(torch.stack([n.square() for n in squares]).sum().sqrt().float())
        if step != 1:
            torch.nn.utils.clip_grads_with_norm_(ref_params, 1.0, norms[-1])
            ref.step()
        report = opt.last_report
        assert report.committed is (step != 1) and report.nonfinite is (step == 1), report
        if step == 1:
            assert math.isnan(report.grad_norm) and "global norm nan" in report.skipped, report
        else:
            assert report.grad_norm == norms[-1].item(), report
    assert 1e19 < norms[2].item() < float("inf")  # applied: the step counts say so below
    for p, q in zip((p for part in parts for p in part.parameters()), ref_params):
        assert torch.equal(p, q) and p.isfinite().all()
    state, theirs = opt.state_dict(), ref.state_dict()["state"]
    names = [name for part in ref_parts for name, _ in part.named_parameters()]
    for i, name in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[f"state.{name}.{key}"], theirs[i][key]), (name, key)
    assert theirs[0]["step"] == 3


def test_in_backward_skips_only_the_units_whose_gradients_are_not_finite():
    parts, ref_parts = three_parts(), three_parts()
    opt = OptimizersInBackwardContainer(parts, torch.optim.AdamW, {"lr": 1e-2})
    ref = OptimizersInBackwardContainer(ref_parts, torch.optim.AdamW, {"lr": 1e-2})
    mid = parts[1].mid.weight
    handle = mid.register_hook(lambda g: g * float("nan"))
    for model, o in ((parts, opt), (ref_parts, ref)):
        o.zero_grad()
        o.backward(forward(model, batch(0)).square().mean())
        o.step()
    handle.remove()
    report = opt.last_report
    assert (
        not report.committed
        and report.nonfinite
        and f"1 of {len(opt.units)} units" in report.skipped
        and report.partial
    )
    stepped = {k: v for k, v in parts[1].state_dict().items()}
    assert torch.equal(stepped["mid.weight"], three_parts()[1].mid.weight)  # skipped
    assert torch.equal(stepped["mid.bias"], three_parts()[1].mid.bias)  # same unit: skipped
    assert not opt.state.get(mid)
    assert_same(parts[0].state_dict(), ref_parts[0].state_dict())  # other units applied
    assert_same(parts[2].state_dict(), ref_parts[2].state_dict())


def test_backward_through_the_container_is_bitwise_plain_backward_when_finite():
    parts, ref_parts = three_parts(), three_parts()
    opt = OptimizersContainer(parts, torch.optim.AdamW, {"lr": 1e-2})
    opt.backward(forward(parts, batch(0)).square().mean())
    forward(ref_parts, batch(0)).square().mean().backward()
    for p, q in zip(
        (p for m in parts for p in m.parameters()), (q for m in ref_parts for q in m.parameters())
    ):
        assert torch.equal(p.grad, q.grad)


def test_without_skip_nonfinite_a_nan_gradient_reaches_the_weights():
    parts = three_parts()
    opt = OptimizersContainer(parts, torch.optim.SGD, {"lr": 1e-2}, skip_nonfinite=False)
    opt.backward(forward(parts, batch(0)).square().mean() * float("inf"))
    opt.step()
    assert opt.last_report.committed and parts[2].head.weight.isnan().any()


def _sharded_fresh_template_is_a_fresh_start() -> bool:
    def build() -> tuple[list[nn.Module], OptimizersContainer]:
        parts = three_parts()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for part in parts:
            fully_shard(part, mesh=mesh)
        kwargs = {"lr": 0.1, "momentum": 0.9, "dampening": 0.5}
        return parts, OptimizersContainer(parts, torch.optim.SGD, kwargs)

    fresh_parts, fresh = build()
    parts, container = build()
    container.load_state_dict(build()[1].state_dict())  # zero buffers: dropped, not damped
    rank = dist.get_rank()
    train(fresh_parts, fresh, 2, rank=rank)
    train(parts, container, 2, rank=rank)
    a, b = fresh.state_dict(), container.state_dict()
    return all(torch.equal(full(a[k]), full(b[k])) for k in a if k.startswith("state."))


def test_a_sharded_fresh_template_loads_as_a_fresh_start():
    assert run_ranks(2, _sharded_fresh_template_is_a_fresh_start) == [True, True]


@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_a_huge_finite_gradient_is_not_taken_for_an_overflow(max_norm):
    # 1e20 squared overflows fp32: the fp32 norm is inf, and only the fp64 pass tells it apart.
    # Without a clip the check is a sum: 1e38 elements overflow it the same way.
    parts, ref_parts = three_parts(), three_parts()
    opt = OptimizersContainer(parts, torch.optim.AdamW, {"lr": 1e-2}, max_norm=max_norm)
    ref = torch.optim.AdamW([p for m in ref_parts for p in m.parameters()], lr=1e-2)
    for step, huge in enumerate([False, True, False]):
        for model in (parts, ref_parts):
            forward(model, batch(step)).square().mean().backward()
            if huge:
                model[1].mid.weight.grad[0, 0] = 1e20
                model[1].mid.weight.grad[1, :2] = 3e38
        grads = [p.grad.double() for m in parts for p in m.parameters()]
        expected = torch.stack([g.square().sum() for g in grads]).sum().sqrt().item()
        opt.step()
        report = opt.last_report
        assert report.committed
        if max_norm is not None:
            assert report.grad_norm == pytest.approx(expected, rel=1e-6)
        if max_norm is not None:
            ref_params = [p for m in ref_parts for p in m.parameters()]
            torch.nn.utils.clip_grads_with_norm_(ref_params, max_norm, opt_norm(report))
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        assert_same(
            {k: v for m in parts for k, v in m.state_dict().items()},
            {k: v for m in ref_parts for k, v in m.state_dict().items()},
        )
    assert all(p.isfinite().all() for m in parts for p in m.parameters())


def opt_norm(report) -> torch.Tensor:
    """The norm the container clipped by: the reported value, as the fp32 tensor it used."""
    return torch.tensor(report.grad_norm, dtype=torch.float64).float()


def test_repr_names_each_group_kind_and_every_part_even_the_plain_ones():
    """The trainer's start line is this repr: what steps must be readable from it alone."""
    from containers import DiLoCo, MixedPrecisionSettings, ShadowWeights

    plain = repr(OptimizersContainer(three_parts(), torch.optim.AdamW, {"lr": 1e-3}))
    assert plain == (
        "OptimizersContainer([AdamW (float32 state) x3]; precision fp32; gate none; "
        "steps after backward)"
    )
    in_backward = OptimizersInBackwardContainer(
        three_parts(), torch.optim.SGD, {"lr": 1e-3}, gradient_accumulation_steps=2,
        ema=ShadowWeights(0.5),
    )  # fmt: skip
    assert "; steps in backward (every 2 passes); ema ShadowWeights(decay=0.5," in repr(in_backward)
    lean = MixedPrecisionOptimizersContainer(
        [p.bfloat16() for p in three_parts()], LeanAdamW,
        {"lr": 1e-3, "moment_dtype": "bfloat16", "fused": True},
        settings=MixedPrecisionSettings(store_param_remainders=True),
    )  # fmt: skip
    assert repr(lean).startswith(
        "MixedPrecisionOptimizersContainer([LeanAdamW (bfloat16 state) x3]; precision "
        "MasterWeights(bfloat16 params, float32 masters as int16 remainders, loss scaling none)"
    )
    outer = DiLoCo(None, sync_steps=4, num_fragments=2)
    diloco = OptimizersContainer(three_parts(), torch.optim.AdamW, {"lr": 1e-3}, outer=outer)
    assert repr(diloco).endswith(
        "; outer DiLoCo(sync_steps=4, num_fragments=2, fragment_sync_delay=0, "
        "fragment_update_alpha=0.0, outer SGD(lr=0.7, momentum=0.9, nesterov=True)))"
    )
