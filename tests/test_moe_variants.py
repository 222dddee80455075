"""The mixture of experts at EP 2 through train.py with the containers and optimizers that
the reshard and torchft tests do not cover: in-backward steps, Muon on each expert, 8-bit
moments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness.dist import REPO, launch

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
    result = launch(2, [*ARGS, *extra, "--job.dump_folder", str(dump)])
    assert result.returncode == 0, result.stdout[-4000:]
    assert named in result.stdout
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert all(r["load_imbalance"] >= 1.0 for r in rows)
