"""`containers.torchtitan` against torchtitan 0.3.0's own optimizer container: built through
torchtitan's `Config.build(model_parts=...)` with torchtitan's param groups (ordered, first
match wins), it steps bitwise as torchtitan's, with the same `state_dict()` keys, checkpoints
cross-load element for element, and torchtitan's LR schedulers drive it."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn
import torchtitan.components.optimizer as titan

from containers import (
    MixedPrecisionOptimizersContainer,
    OptimizersContainer,
)
from containers import torchtitan as oc

ParamGroupConfig = titan.ParamGroupConfig

# torchtitan's own kind of list: three specific groups, first match wins, a catch-all last.
GROUPS = [
    ParamGroupConfig(pattern=r"^embed\.", optimizer_name="AdamW",
                     optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.0}),
    ParamGroupConfig(pattern=r"norm", optimizer_name="AdamW",
                     optimizer_kwargs={"lr": 2e-3, "weight_decay": 0.0, "betas": (0.9, 0.99)}),
    ParamGroupConfig(pattern=r"bias$", optimizer_name="Adam", optimizer_kwargs={"lr": 5e-4}),
    ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                     optimizer_kwargs={"lr": 3e-3, "weight_decay": 0.1}),
]  # fmt: skip


def _model(seed: int = 0) -> nn.Module:
    """Every pattern above takes something, and `norm.bias` two patterns match (first wins)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        OrderedDict(
            embed=nn.Embedding(11, 8),
            mid=nn.Linear(8, 8),
            norm=nn.LayerNorm(8),
            head=nn.Linear(8, 5),
        )
    )


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    torch.manual_seed(100 + step)
    tokens = torch.randint(0, 11, (4, 6))
    opt.zero_grad()
    model(tokens).pow(2).mean().backward()
    opt.step()


def _pair(**ours) -> tuple[nn.Module, object, nn.Module, object]:
    mine, theirs = _model(), _model()
    a = oc.OptimizersContainer.Config(param_groups=GROUPS, **ours).build(model_parts=[mine])
    b = titan.OptimizersContainer.Config(param_groups=GROUPS).build(model_parts=[theirs])
    return mine, a, theirs, b


def _same(a: dict, b: dict) -> list[str]:
    """Keys whose values differ (tensors bitwise, the rest by ==)."""
    return [
        k
        for k in a
        if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])
    ]


def test_built_through_torchtitans_config_it_steps_bitwise_as_torchtitans_container():
    mine, ours, theirs, reference = _pair()
    assert type(ours) is OptimizersContainer
    for step in range(4):
        _step(mine, ours, step)
        _step(theirs, reference, step)
    assert _same(mine.state_dict(), theirs.state_dict()) == []
    a, b = ours.state_dict(), reference.state_dict()
    assert a.keys() == b.keys()
    assert _same(a, b) == []
    # First match wins: norm.bias is in the norm group (betas 0.99), not the Adam bias group.
    assert a["param_groups.norm.bias.betas"] == (0.9, 0.99)
    assert a["param_groups.mid.bias.lr"] == 5e-4 and a["param_groups.head.weight.lr"] == 3e-3


def test_checkpoints_cross_load_both_ways_element_for_element():
    mine, ours, theirs, reference = _pair()
    for step in range(3):
        _step(mine, ours, step)
        _step(theirs, reference, step + 7)  # another history
    theirs_sd = copy.deepcopy(reference.state_dict())
    ours.load_state_dict(theirs_sd)
    assert _same(ours.state_dict(), theirs_sd) == []
    fresh_model, fresh = _model(1), None
    fresh = titan.OptimizersContainer.Config(param_groups=GROUPS).build(model_parts=[fresh_model])
    _step(mine, ours, 9)
    ours_sd = copy.deepcopy(ours.state_dict())
    fresh.load_state_dict(ours_sd)
    assert _same(fresh.state_dict(), ours_sd) == []


def test_torchtitans_lr_scheduler_steps_our_groups_as_it_steps_its_own():
    mine, ours, theirs, reference = _pair()
    config = titan.LRSchedulersContainer.Config(warmup_steps=2, decay_type="cosine")
    ours_lr = config.build(optimizers=ours, training_steps=6)
    theirs_lr = config.build(optimizers=reference, training_steps=6)
    for step in range(5):
        _step(mine, ours, step)
        _step(theirs, reference, step)
        ours_lr.step()
        theirs_lr.step()
        lrs = {k: v for k, v in ours.state_dict().items() if k.endswith(".lr")}
        assert lrs == {k: v for k, v in reference.state_dict().items() if k.endswith(".lr")}
    assert ours_lr.get_metrics() == theirs_lr.get_metrics()
    assert len({v for k, v in lrs.items()}) == 4  # each group on its own base lr
    assert _same(mine.state_dict(), theirs.state_dict()) == []


def test_the_variants_and_lean_moments_are_the_librarys_containers():
    bf16 = oc.OptimizersContainer.Config(
        param_groups=GROUPS, implementation="fused_opt_states_bf16"
    )
    opt = bf16.build(model_parts=[_model()])
    assert {type(o).__name__ for o in opt.optimizers} == {"LeanAdam", "LeanAdamW"}
    assert {g["moment_dtype"] for g in opt.param_groups} == {"bfloat16"}


def test_mixed_precision_keeps_the_exact_fp32_init_as_masters():
    model = _model()
    init = {k: v.clone() for k, v in model.named_parameters()}
    for remainders in (False, True):
        model = _model()
        config = oc.OptimizersContainer.Config(
            param_groups=GROUPS, container="mixed_precision", store_param_remainders=remainders
        )
        opt = config.build(model_parts=[model])
        assert type(opt) is MixedPrecisionOptimizersContainer
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        masters = {
            k.removeprefix("master_weights."): v
            for k, v in opt.state_dict().items()
            if k.startswith("master_weights.")
        }
        assert masters.keys() == init.keys(), masters.keys()
        assert all(torch.equal(masters[k], init[k]) for k in init), remainders
        assert any(not torch.equal(init[k], init[k].bfloat16().float()) for k in init)


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"param_dtype": "float16", "container": "mixed_precision"},
         "optimizer.param_dtype = 'float16': float16 weights need loss scaling, and "
         "torchtitan's Trainer calls loss.backward() itself; use 'bfloat16'"),
        ({"implementation": "fused_opt_states_bf16", "moment_dtype": "8bit"},
         "optimizer.implementation = 'fused_opt_states_bf16' keeps bf16 moments, "
         "optimizer.moment_dtype = '8bit' asks otherwise"),
        ({"ema_decay": 1.5}, "optimizer.ema_decay = 1.5: use 0 (no EMA) or a decay in (0, 1)"),
    ],
)  # fmt: skip
def test_what_a_torchtitan_job_cannot_have_is_one_line_in_its_config(fields, said):
    with pytest.raises(ValueError) as refused:
        oc.OptimizersContainer.Config(param_groups=GROUPS, **fields)
    assert said in str(refused.value) and "\n" not in str(refused.value)


def test_in_backward_outside_torchtitans_trainer_is_refused_in_one_line():
    """Its clip and gradient accumulation live in the Trainer's config (its test builds it
    there: test_trainer.py)."""
    config = oc.OptimizersContainer.Config(param_groups=GROUPS, container="in_backward")
    with pytest.raises(ValueError, match=r"^optimizer.container = 'in_backward' is built outs"):
        config.build(model_parts=[_model()])


def test_masters_keep_the_fp32_init_under_activation_checkpointing_wrappers():
    """torchtitan wraps blocks for activation checkpointing before the optimizer is built:
    the names differ from the checkpoint FQNs the masters are found by."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _model()
    model.mid = checkpoint_wrapper(model.mid)
    init = {k.replace("_checkpoint_wrapped_module.", ""): v.clone()
            for k, v in model.named_parameters()}  # fmt: skip
    config = oc.OptimizersContainer.Config(param_groups=GROUPS, container="mixed_precision")
    masters = {
        k.removeprefix("master_weights."): v
        for k, v in config.build(model_parts=[model]).state_dict().items()
        if k.startswith("master_weights.")
    }
    assert masters.keys() == init.keys()
    assert all(torch.equal(masters[k], init[k]) for k in init)


def test_a_parameter_no_group_takes_is_refused_as_torchtitan_refuses_it():
    with pytest.raises(ValueError, match=r"'mid.weight' matches no optimizer.param_groups"):
        oc.OptimizersContainer.Config(param_groups=GROUPS[:3]).build(model_parts=[_model()])
