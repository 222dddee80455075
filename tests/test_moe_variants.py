"""The mixture of experts at EP 2 through train.py with the containers and optimizers that
the reshard and torchft tests do not cover: in-backward steps, Muon on each expert, 8-bit
moments; and a skipped step, which leaves the load balancing as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.harness.dist import REPO, train_ranks
from tests.test_reshard import _stored

ARGS = [
    "--job.config_file", "config/moe.toml", "--model.flavor", "tiny",
    "--training.seq_len", "32", "--training.local_batch_size", "4",
    "--training.steps", "8", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
    "--checkpoint.enable", "false", "--parallelism.expert_parallel_degree", "2",
]  # fmt: skip
MUON = """
[[optimizer.param_groups]]
pattern = 'layers\\..*\\.(attention\\..*weight|moe\\.experts\\.w[123])'
name = "Muon"
lr = 1e-2
adjust_lr_fn = "match_rms_adamw"
"""


def _variant(name: str, tmp_path: Path) -> tuple[list[str], str]:
    """Extra train.py arguments of a variant, and what its start line names."""
    if name == "8bit":
        return ["--optimizer.moment_dtype", "8bit"], "8bit state"
    if name == "in_backward":  # (no clip: the global norm exists only after backward)
        return ["--optimizer.container", "in_backward", "--training.max_norm", "0"], "in backward"
    toml = tmp_path / "moe_muon.toml"
    toml.write_text(Path(REPO, "config", "moe.toml").read_text() + MUON)
    return ["--job.config_file", str(toml)], "ShardedMuon"


@pytest.mark.parametrize("name", ["in_backward", "muon", "8bit"])
def test_an_ep2_job_trains_with(name, tmp_path):
    extra, named = _variant(name, tmp_path)
    dump = tmp_path / "run"
    result = train_ranks(2, [*ARGS, *extra, "--job.dump_folder", str(dump)])
    assert result.returncode == 0, result.stdout[-4000:]
    assert named in result.stdout
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert all(r["load_imbalance"] >= 1.0 for r in rows)


def test_a_skipped_step_leaves_the_expert_biases_and_counts_as_they_were(tmp_path):
    """Gradients of step 3 hold inf (tests.harness.faults): the step is skipped, and the
    checkpoint written after it holds step 2's biases and load-balancing counts."""
    dump = tmp_path / "run"
    args = [*ARGS, "--training.steps", "3", "--checkpoint.enable", "true"]
    args += ["--checkpoint.interval", "2", "--job.dump_folder", str(dump)]
    result = train_ranks(2, args, faults=("overflow", "3"))
    assert result.returncode == 0, result.stdout[-4000:]
    assert "step 3 skipped: non-finite" in result.stdout
    before, after = _stored(dump, 2), _stored(dump, 3)
    kept = {
        k: v
        for part in ("model", "optimizer")
        for k, v in before[part].items()
        if k.endswith("expert_bias") or k.startswith("load_balance.")
    }
    assert len(kept) == 4 and any(v.any() for v in kept.values())
    for key, value in kept.items():
        part = "model" if key.endswith("expert_bias") else "optimizer"
        assert torch.equal(after[part][key], value), key
