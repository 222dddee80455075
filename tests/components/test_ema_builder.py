"""`[ema]` -> ShadowWeights, and train.py's held-out losses and export with the EMA weights."""

from __future__ import annotations

import json

import pytest
import torch

from components.ema_builder import build_ema
from config import EMA, load_job_config
from tests.harness.dist import train_ranks
from tests.harness.helpers import load_job_state
from tests.test_train import BASE


def test_the_section_builds_the_average_and_a_half_life_sets_its_decay():
    assert build_ema(EMA()) is None
    ema = build_ema(EMA(enable=True, half_life=8.0, update_every_n_steps=2, start_step=5))
    assert ema.decay == 0.5**0.25 and ema.every == 2 and ema.start_step == 5
    assert build_ema(EMA(enable=True, decay=0.99)).decay == 0.99
    with pytest.raises(
        ValueError, match=r"\[ema\] eval_every = 5: only \[ema\] enable = true reads it"
    ):
        load_job_config(["--ema.eval_every", "5"])


def test_train_py_logs_held_out_losses_and_exports_the_averaged_weights(tmp_path):
    """6 steps, decay 0.5, eval every 3, `[ema] export`: held-out losses of both weights at
    steps 3 and 6, and the exported file holds the checkpoint's EMA (the default container
    averages the parameters themselves), not the trained weights."""
    args = [*BASE, "--job.dump_folder", str(tmp_path), "--training.steps", "6"]
    args += ["--ema.enable", "--ema.decay", "0.5", "--ema.eval_every", "3", "--ema.export"]
    args += ["--checkpoint.enable", "--checkpoint.export_model"]
    result = train_ranks(1, args)
    assert result.returncode == 0, result.stdout[-4000:]
    held_out = [line for line in result.stdout.splitlines() if "held-out loss" in line]
    assert len(held_out) == 2 and "step     3" in held_out[0], held_out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evaluated = {r["step"]: (r["eval_loss"], r["ema_eval_loss"]) for r in rows if "eval_loss" in r}
    assert sorted(evaluated) == [3, 6] and evaluated[6][0] != evaluated[6][1]

    state = load_job_state(str(tmp_path), [*BASE, "--ema.enable", "--checkpoint.enable"])
    assert state["optim"]["ema.steps"] == 6
    exported = torch.load(tmp_path / "checkpoint" / "model-step-6.pt")
    for fqn, value in exported.items():
        assert torch.equal(value, state["optim"][f"ema.{fqn}"]), fqn
    assert any(not torch.equal(v, state["model"][k]) for k, v in exported.items())


@pytest.fixture(scope="module")
def seed_without_ema(tmp_path_factory) -> str:
    """A checkpoint of 2 steps of a run without an EMA."""
    seed = tmp_path_factory.mktemp("seed")
    args = [*BASE, "--job.dump_folder", str(seed), "--training.steps", "2"]
    assert train_ranks(1, [*args, "--checkpoint.enable"]).returncode == 0
    return str(seed / "checkpoint" / "step-2")


@pytest.mark.parametrize("model_only", [True, False], ids=["model_only", "whole"])
def test_a_seed_without_an_ema_starts_the_average_from_the_seeded_weights(
    tmp_path, seed_without_ema, model_only
):
    """`initial_load_path` from a run without an EMA, model only or whole: the average is the
    seeded weights, not this job's random initialization."""
    argv = [*BASE, "--ema.enable", "--checkpoint.enable"]
    argv += ["--checkpoint.initial_load_path", seed_without_ema]
    argv += ["--checkpoint.initial_load_model_only", str(model_only).lower()]
    state = load_job_state(str(tmp_path / "seeded"), argv)
    assert state["step"] == (0 if model_only else 2) and state["optim"]["ema.steps"] == 0
    for fqn, weight in state["model"].items():
        assert torch.equal(state["optim"][f"ema.{fqn}"], weight), fqn
