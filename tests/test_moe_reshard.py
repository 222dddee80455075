"""Mixture-of-experts checkpoints move between expert-parallel degrees, through train.py.

Saved at EP 2 x DP 2 (4 ranks) under mixed precision, with fp32 masters and an EMA, or with
masters kept as remainders, 8-bit moments and an EMA of the masters; resumed at EP 4, EP 1 x
DP 4, on 3 ranks and in one process, and at EP 2 x DP 2 again. Each resumed run hands back the
state its layout loaded, gathered at its first optimizer step: weights, expert biases, moments,
masters or remainders, the EMA and the load-balancing counts must equal the checkpoint's bytes
element for element. At the saving layout the resumed run is the uninterrupted one, bitwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.dist import REPO, run_ranks, run_script, train_ranks
from tests.harness.helpers import train_resumed
from tests.test_reshard import _merged, _metrics, _mismatches, _stored
from tests.test_train import _resume_copy

GLOBAL_BATCH = 24  # dp 1, 3 and 4 all divide it with local_batch_size 2
ARGS = [
    "--job.config_file", "config/moe.toml", "--model.flavor", "tiny",
    "--training.seq_len", "32", "--training.local_batch_size", "2",
    "--training.global_batch_size", str(GLOBAL_BATCH), "--checkpoint.interval", "4",
    "--lr_scheduler.warmup_steps", "6", "--lr_scheduler.decay_ratio", "0",
    "--metrics.log_freq", "1", "--optimizer.container", "mixed_precision",
]  # fmt: skip
STATES = {  # what the saving run keeps beside the bf16 weights
    "masters_ema": ["--ema.enable", "true"],
    "remainders_ema": [
        "--mixed_precision.store_param_remainders", "true",
        "--optimizer.moment_dtype", "8bit", "--ema.enable", "true",
    ],
}  # fmt: skip
LAYOUTS = {  # name: (ranks, expert_parallel_degree)
    "ep2_dp2": (4, 2),
    "ep4": (4, 4),
    "ep1_dp4": (4, 1),
    "dp3": (3, 1),
    "one": (1, 1),
}


def _argv(states: str, layout: str, steps: int, dump: Path) -> list[str]:
    ep = str(LAYOUTS[layout][1])
    return [*ARGS, *STATES[states], "--parallelism.expert_parallel_degree", ep,
            "--training.steps", str(steps), "--job.dump_folder", str(dump)]  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per kind of state, the uninterrupted run at EP 2 x DP 2 to step 6, with step-4."""
    root = tmp_path_factory.mktemp("moe_reshard")
    runs = {}
    for states in STATES:
        dump = root / states
        result = train_ranks(4, _argv(states, "ep2_dp2", 6, dump))
        assert result.returncode == 0, result.stdout[-6000:]
        runs[states] = dump
    return runs


@pytest.mark.parametrize(
    "states, layout",
    [
        ("masters_ema", "ep2_dp2"),
        ("masters_ema", "ep4"),
        ("masters_ema", "ep1_dp4"),
        ("masters_ema", "dp3"),
        ("masters_ema", "one"),
        ("remainders_ema", "ep4"),
        ("remainders_ema", "ep2_dp2"),
    ],
)
@pytest.mark.slow
def test_an_ep2_dp2_checkpoint_resumes_element_for_element_at(states, layout, saved, tmp_path):
    src, dump = saved[states], tmp_path / layout
    _resume_copy(src, dump, 4)
    nproc = LAYOUTS[layout][0]
    ranks = run_ranks(nproc, train_resumed, _argv(states, layout, 6, dump), timeout=240)
    assert [r["code"] for r in ranks] == [0] * nproc
    stored = _stored(src, 4)
    optim, model = _merged(ranks, "optim"), _merged(ranks, "model")
    assert any(k.startswith("load_balance.") for k in optim)
    assert any(k.endswith("moe.experts.w1") for k in model)
    assert any(k.endswith("moe.expert_bias") for k in model)
    assert any(k.startswith("ema.") for k in optim)
    if states == "masters_ema":
        assert any(k.startswith("master_weights.") for k in optim)
    assert _mismatches(optim, stored["optimizer"]) == {}
    assert _mismatches(model, stored["model"]) == {}
    for rank in ranks:
        assert rank["step"] == 4 and rank["sched"] == 4
        assert rank["sample_index"] == 5 * GLOBAL_BATCH
    got, want = _metrics(dump), _metrics(src)
    assert sorted(got) == [5, 6]
    for step, row in got.items():
        assert row["lr"] == want[step]["lr"]
        if layout == "ep2_dp2":  # the same layout: the uninterrupted run, bitwise
            assert row["loss"] == want[step]["loss"]
            assert row["load_imbalance"] == want[step]["load_imbalance"]
        else:  # bf16 weights, sums in another order
            assert row["loss"] == pytest.approx(want[step]["loss"], rel=1e-2)
    if layout == "ep2_dp2":
        assert _mismatches(_stored(dump, 6)["optimizer"], _stored(src, 6)["optimizer"]) == {}
        assert _mismatches(_stored(dump, 6)["model"], _stored(src, 6)["model"]) == {}


def test_inspect_lists_the_expert_tensors_biases_and_load_balancing_counts(saved):
    step = saved["masters_ema"] / "checkpoint" / "step-4"
    done = run_script("inspect", str(step), cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "layers.0.moe.experts.w1" in out and "(4, 64, 32)" in out  # [E, dim, hidden]
    assert "layers.0.moe.expert_bias" in out
    assert "optimizer load_balance" in out and "layers.0.moe.tokens_per_expert" in out
