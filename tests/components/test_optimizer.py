"""Optimizer and container registries and `build_optimizers`."""

from __future__ import annotations

import copy

import pytest
import torch

from components import optimizer as registry
from components.optimizer import (
    build_optimizers,
    implementation_kwargs,
    register_container,
    register_optimizer,
)
from config import ConfigError, ParamGroup, load_job_config
from config import Optimizer as OptimizerConfig
from containers import OptimizersContainer
from tests.harness.helpers import three_parts, train


@pytest.fixture
def restore_registries():
    saved = dict(registry._OPTIMIZERS), dict(registry._CONTAINERS)
    yield
    registry._OPTIMIZERS.clear()
    registry._OPTIMIZERS.update(saved[0])
    registry._CONTAINERS.clear()
    registry._CONTAINERS.update(saved[1])


def _inner(container: OptimizersContainer) -> list[dict]:
    return [g for g in container.param_groups]


@pytest.mark.parametrize(
    ("name", "cls"),
    [("AdamW", torch.optim.AdamW), ("Adam", torch.optim.Adam), ("SGD", torch.optim.SGD)],
)
def test_builtin_optimizers_build_from_config(name, cls):
    cfg = OptimizerConfig(name=name, lr=3e-3, weight_decay=0.05, momentum=0.5)
    container = build_optimizers(three_parts(), cfg)
    assert type(container) is OptimizersContainer
    assert all(type(o) is cls for o in container)
    group = container.param_groups[0]
    assert group["lr"] == 3e-3 and group["weight_decay"] == 0.05
    if cls is not torch.optim.SGD:
        assert group["betas"] == (0.9, 0.95) and group["eps"] == 1e-8
    else:
        assert group["momentum"] == 0.5


def test_auto_picks_fused_on_cpu_and_matches_torch_fused_bitwise():
    parts = three_parts()
    ref_parts = copy.deepcopy(parts)
    container = build_optimizers(parts, OptimizerConfig(lr=1e-2))
    assert all(g["fused"] is True for g in container.param_groups)
    ref = torch.optim.AdamW(
        [p for m in ref_parts for p in m.parameters()],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        fused=True,
    )
    train(parts, container, 5)
    train(ref_parts, ref, 5)
    for a, b in zip(
        (p for m in parts for p in m.parameters()), (p for m in ref_parts for p in m.parameters())
    ):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("impl", "flags"),
    [
        ("fused", {"fused": True}),
        ("foreach", {"foreach": True, "fused": False}),
        ("for-loop", {"foreach": False, "fused": False}),
    ],
)
def test_explicit_implementations(impl, flags):
    container = build_optimizers(three_parts(), OptimizerConfig(implementation=impl))
    for group in container.param_groups:
        for key, value in flags.items():
            assert group[key] is value


def test_impossible_implementation_is_a_clear_error():
    class NoFlags(torch.optim.SGD):
        def __init__(self, params, lr: float = 0.1) -> None:
            super().__init__(params, lr=lr)

    with pytest.raises(ConfigError, match=r"implementation = 'fused': NoFlags has no fused"):
        implementation_kwargs(NoFlags, "fused", torch.device("cpu"), "[optimizer]")
    with pytest.raises(ConfigError, match=r"implementation = 'foreach': NoFlags takes no"):
        implementation_kwargs(NoFlags, "foreach", torch.device("cpu"), "[optimizer]")
    with pytest.raises(ConfigError, match=r"Adamax has no fused kernel"):
        implementation_kwargs(torch.optim.Adamax, "fused", torch.device("cpu"), "[optimizer]")
    with pytest.raises(ConfigError, match=r"AdamW has none on meta"):
        implementation_kwargs(torch.optim.AdamW, "fused", torch.device("meta"), "[optimizer]")
    assert implementation_kwargs(NoFlags, "auto", torch.device("cpu"), "[optimizer]") == {}


def test_register_optimizer_adds_one_and_refuses_duplicates(restore_registries):
    register_optimizer("Adamax", lambda cfg: (torch.optim.Adamax, {"lr": cfg.lr}))
    container = build_optimizers(three_parts(), OptimizerConfig(name="Adamax", lr=0.02))
    assert all(type(o) is torch.optim.Adamax for o in container)
    assert container.param_groups[0]["foreach"] is None  # auto: Adamax has no fused kernel
    with pytest.raises(ValueError, match="'Adamax' is already registered"):
        register_optimizer("Adamax", lambda cfg: (torch.optim.Adamax, {}))
    with pytest.raises(ValueError, match="'AdamW' is already registered"):
        register_optimizer("AdamW", lambda cfg: (torch.optim.AdamW, {}))
    with pytest.raises(ValueError, match="not callable"):
        register_optimizer("Broken", "not a factory")


def test_register_container_selects_by_name(restore_registries):
    class Counting(OptimizersContainer):
        steps = 0

        def step(self, closure=None):
            Counting.steps += 1
            return super().step(closure)

    def factory(parts, cls, kwargs, *, param_groups, marker, **composed):
        assert marker == 7
        assert composed.keys() == {"precision", "gate", "timing", "max_norm", "mesh"}
        return Counting(parts, cls, kwargs, param_groups=param_groups, **composed)

    register_container("counting", factory)
    parts = three_parts()
    container = build_optimizers(parts, OptimizerConfig(container="counting"), marker=7)
    train(parts, container, 2)
    assert type(container) is Counting and Counting.steps == 2
    with pytest.raises(ValueError, match="'default' is already registered"):
        register_container("default", factory)


def test_unknown_names_list_the_registered_ones():
    with pytest.raises(ConfigError, match=r"name = 'Lion': unknown optimizer; registered: Adam"):
        build_optimizers(three_parts(), OptimizerConfig(name="Lion"))
    with pytest.raises(ConfigError, match=r"container = 'nope': unknown container; registered"):
        build_optimizers(three_parts(), OptimizerConfig(container="nope"))


def test_param_groups_from_toml(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text(
        "[optimizer]\nname = 'AdamW'\nlr = 0.01\nweight_decay = 0.1\n"
        "[[optimizer.param_groups]]\npattern = '\\.bias$|norm'\nweight_decay = 0.0\n"
        "[[optimizer.param_groups]]\npattern = '^head\\.weight$'\nname = 'SGD'\nlr = 0.5\n"
    )
    cfg = load_job_config(["--job.config_file", str(toml)])
    container = build_optimizers(three_parts(), cfg.optimizer)
    assert [type(o).__name__ for o in container] == ["AdamW", "AdamW", "AdamW", "SGD"]
    sd = container.state_dict()
    assert sd["param_groups.head.bias.weight_decay"] == 0.0
    assert sd["param_groups.norm.weight.weight_decay"] == 0.0
    assert sd["param_groups.mid.weight.weight_decay"] == 0.1
    assert sd["param_groups.head.weight.lr"] == 0.5
    assert sd["param_groups.head.weight.weight_decay"] == 0.1
    # the head's bias matches both patterns
    bad = [ParamGroup(pattern="bias", weight_decay=0.0), ParamGroup(pattern="head")]
    with pytest.raises(ConfigError, match=r"\[optimizer\] parameter 'head.bias' matches"):
        build_optimizers(three_parts(), OptimizerConfig(param_groups=bad))
    none = [ParamGroup(pattern="^nothing$", lr=0.1)]
    with pytest.raises(ConfigError, match=r"\['\^nothing\$'\] match no trainable parameter"):
        build_optimizers(three_parts(), OptimizerConfig(param_groups=none))
    unknown = [ParamGroup(pattern="head", name="Lion")]
    with pytest.raises(ConfigError, match=r"param_groups\[0\]\] name = 'Lion': unknown"):
        build_optimizers(three_parts(), OptimizerConfig(param_groups=unknown))
