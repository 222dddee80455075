"""containers/optim/paths: one function names each group's update path; a job logs it once."""

from __future__ import annotations

import logging

import pytest
import torch

from containers import (
    LeanAdamW,
    MixedPrecisionOptimizersContainer,
    MixedPrecisionSettings,
    OptimizersContainer,
    ParamGroupRule,
)
from containers.optim.paths import PATHS, update_path
from tests.harness.helpers import three_parts


def _step(opt: OptimizersContainer, parts: list[torch.nn.Module]) -> None:
    for part in parts:
        for p in part.parameters():
            p.grad = torch.ones_like(p)
    opt.step()


@pytest.mark.parametrize(
    ("cls", "kwargs", "path"),
    [
        (torch.optim.AdamW, {"fused": True}, "torch"),
        (torch.optim.AdamW, {"foreach": True}, "torch"),
        (torch.optim.SGD, {"momentum": 0.9}, "torch"),
        (LeanAdamW, {"moment_dtype": "bfloat16"}, "bf16 scratch"),
        (LeanAdamW, {"moment_dtype": "8bit"}, "8bit scratch"),
        (LeanAdamW, {"compiled": True}, "compiled"),
        (LeanAdamW, {"moment_dtype": "8bit", "compiled": True}, "8bit compiled"),
    ],
)
def test_each_group_logs_its_update_path_once_at_its_first_step(cls, kwargs, path, caplog):
    parts = three_parts()
    opt = OptimizersContainer(
        parts, cls, {"lr": 1e-3, **kwargs},
        param_groups=[ParamGroupRule("head", optimizer_cls=torch.optim.SGD,
                                     optimizer_kwargs={"lr": 0.1})],
    )  # fmt: skip
    assert path in PATHS
    with caplog.at_level(logging.INFO, logger="containers.container"):
        if "compiled" not in kwargs:  # (the graph's first compile is tested with the graph)
            _step(opt, parts)
            _step(opt, parts)
    lines = [r.getMessage() for r in caplog.records if r.name == "containers.container"]
    name = cls.__name__
    if "compiled" not in kwargs:
        assert f"update path: {name}[0]: {path}" in lines
        assert "update path: SGD[0]: torch" in lines
        assert len(lines) == len(set(lines)) == 2 - (cls is torch.optim.SGD)  # once each
    assert next(update_path(o, g) for o in opt for g in o.param_groups) == path


def test_mixed_precision_groups_name_the_masters_paths(caplog):
    parts = [part.bfloat16() for part in three_parts()]
    opt = MixedPrecisionOptimizersContainer(
        parts, torch.optim.AdamW, {"lr": 1e-3, "fused": True},
        param_groups=[ParamGroupRule("head", optimizer_cls=torch.optim.SGD,
                                     optimizer_kwargs={"lr": 0.1})],
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="containers.container"):
        _step(opt, parts)
    lines = {r.getMessage() for r in caplog.records if r.name == "containers.container"}
    assert lines == {
        "update path: AdamW[0]: masters flat",
        "update path: SGD[0]: masters per tensor",
    }


def test_masters_kept_as_remainders_name_the_flat_path_they_step(caplog):
    """At rest a remainder master is a stride-0 view (not contiguous): the path is the one
    the precision steps the group on, not one derived again from the tensors."""
    parts = [part.bfloat16() for part in three_parts()]
    opt = MixedPrecisionOptimizersContainer(
        parts, torch.optim.AdamW, {"lr": 1e-3, "fused": True},
        settings=MixedPrecisionSettings(store_param_remainders=True),
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="containers.container"):
        _step(opt, parts)
    lines = {r.getMessage() for r in caplog.records if r.name == "containers.container"}
    assert lines == {"update path: AdamW[0]: masters flat"}
