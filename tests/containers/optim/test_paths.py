"""containers/update/plan: one function chooses each group's plan; its name is the group's
`update path` line, logged once, and ARCHITECTURE.md's table of plans is what the configs
build."""

from __future__ import annotations

import dataclasses
import logging
import re
import shlex
from pathlib import Path

import pytest
import torch

from components.optimizer import build_optimizers, build_precision, cast_model
from components.train_spec import get_train_spec
from config import load_job_config
from containers import (
    LeanAdamW,
    MixedPrecisionOptimizersContainer,
    MixedPrecisionSettings,
    OptimizersContainer,
    ParamGroupRule,
)
from containers.update.plan import Plan, plan_of
from tests.harness.dist import REPO
from tests.harness.helpers import plan_table, three_parts


def _commands(logged: str) -> list[list[str]]:
    """`debug.toml`, `debug.toml `--a b``: config file and overrides, one per entry."""
    out = []
    for entry in re.findall(r"([a-z_]+\.toml)(?: `([^`]*)`)?", logged):
        out.append(["--job.config_file", f"config/{entry[0]}", *shlex.split(entry[1])])
    return out


def _plans(argv: list[str]) -> set[str]:
    """The plan names a job of `argv` logs: its model and optimizer built in this process."""
    cfg = load_job_config(argv).optimizer
    if cfg.container == "fault_tolerant":  # (its gate changes no plan; it needs a manager)
        cfg = dataclasses.replace(cfg, container="default")
    job = load_job_config(argv)
    precision = build_precision(cfg, job.mixed_precision)
    torch.manual_seed(0)
    model = cast_model(precision, get_train_spec(job.model.name).build_model_fn(job.model))
    container = build_optimizers([model], cfg, precision=precision)
    return {
        container.precision.plan(o, i).name for o in container for i in range(len(o.param_groups))
    }


def test_the_table_of_plans_is_what_each_config_builds():
    """Each row's configs log its plan, every config in config/ is in a row, and every plan
    those configs build has its row."""
    rows = plan_table()
    assert len(rows) >= 12
    names, built, tomls = {r["name"] for r in rows}, set(), set()
    for row in rows:
        driver, masters, moments = (row[k].strip() for k in ("driver", "masters", "moments"))
        # (a torch plan's moments are the optimizer's own: not in the name)
        plan = Plan("torch", masters) if driver == "torch" else Plan(driver, masters, moments)
        assert plan.name == row["name"], row
        commands = _commands(row["logged"])
        assert commands, row
        for argv in commands:
            plans = _plans(argv)
            assert row["name"] in plans, (argv, plans)
            built |= plans
            tomls.add(argv[1])
    assert built <= names, built - names
    assert tomls == {f"config/{p.name}" for p in (Path(REPO) / "config").glob("*.toml")}


def _step(opt: OptimizersContainer, parts: list[torch.nn.Module]) -> None:
    for part in parts:
        for p in part.parameters():
            p.grad = torch.ones_like(p)
    opt.step()


@pytest.mark.parametrize(
    ("cls", "kwargs", "name"),
    [
        (torch.optim.AdamW, {"fused": True}, "torch"),
        (torch.optim.SGD, {"momentum": 0.9}, "torch"),
        (LeanAdamW, {"moment_dtype": "bfloat16"}, "chunked, bfloat16 moments"),
        (LeanAdamW, {"moment_dtype": "8bit"}, "chunked, 8bit moments"),
    ],
)
def test_each_group_logs_its_plan_once_at_its_first_step(cls, kwargs, name, caplog):
    parts = three_parts()
    opt = OptimizersContainer(
        parts, cls, {"lr": 1e-3, **kwargs},
        param_groups=[ParamGroupRule("head", optimizer_cls=torch.optim.SGD,
                                     optimizer_kwargs={"lr": 0.1})],
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="containers.container"):
        _step(opt, parts)
        _step(opt, parts)
    lines = [r.getMessage() for r in caplog.records if r.name == "containers.container"]
    assert f"update path: {cls.__name__}[0]: {name}" in lines
    assert "update path: SGD[0]: torch" in lines
    assert len(lines) == len(set(lines)) == 2 - (cls is torch.optim.SGD)  # once each
    assert plan_of(cls, opt.optimizers[0].param_groups[0]).name == name


def test_masters_kept_as_remainders_name_the_plan_they_were_built_with(caplog):
    """At rest a remainder master is a stride-0 view (not contiguous): the plan is the one
    the precision made when built, not one derived again from the tensors."""
    parts = [part.bfloat16() for part in three_parts()]
    opt = MixedPrecisionOptimizersContainer(
        parts, torch.optim.AdamW, {"lr": 1e-3, "fused": True},
        settings=MixedPrecisionSettings(store_param_remainders=True),
        param_groups=[ParamGroupRule("head", optimizer_cls=torch.optim.SGD,
                                     optimizer_kwargs={"lr": 0.1})],
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="containers.container"):
        _step(opt, parts)
    lines = {r.getMessage() for r in caplog.records if r.name == "containers.container"}
    assert lines == {
        "update path: AdamW[0]: chunked, remainders masters, float32 moments",
        "update path: SGD[0]: torch, fp32 masters",
    }
