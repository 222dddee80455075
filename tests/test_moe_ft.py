"""The mixture of experts under torchft, expert parallelism inside each replica group: a real
lighthouse, replica groups of 2 train.py ranks at EP 2, a real kill and heal; and DiLoCo."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.containers.gate.test_fault_tolerant import _final_states, _kill_and_heal
from tests.harness.ftjob import FTJob
from tests.test_reshard import _stored

MOE = {"config/debug.toml": "config/moe.toml", "debug": "tiny"}
EP2 = ["--parallelism.expert_parallel_degree", "2", "--training.seq_len", "32"]


def _moe_job(folder: Path, steps: int, extra: list[str], **kwargs) -> FTJob:
    """An `FTJob` of the tiny MoE at EP 2 in each group of 2 ranks."""
    job = FTJob(folder, steps, [*EP2, *extra], nproc=2, **kwargs)
    job.args = [MOE.get(a, a) for a in job.args]
    return job


@pytest.mark.slow
def test_a_killed_ep_group_heals_and_every_group_ends_with_the_same_experts_and_biases(tmp_path):
    """Group 1 is killed, group 0 commits alone, group 1 restarts and heals from it; every
    committed step is the same on both (weights and the load-balancing counts, summed over
    the groups of each quorum), and they end bitwise equal, expert biases included."""
    job = _moe_job(tmp_path, 10, [])
    survivor, healed, _ = _kill_and_heal(job, hold=6, kill_after=2)
    for step in sorted(set(survivor) & set(healed)):
        assert survivor[step]["param_checksum"] == healed[step]["param_checksum"], step
        assert survivor[step]["load_imbalance"] == healed[step]["load_imbalance"], step
    job.args += ["--parallelism.expert_parallel_degree", "1"]  # read back in one process
    model, optim = (_final_states(job)[0][k] for k in ("model", "optim"))
    biases = [v for k, v in model.items() if k.endswith("moe.expert_bias")]
    assert biases and any(b.any() for b in biases)  # (equal on both groups: _final_states)
    assert any(k.startswith("load_balance.") for k in optim)


@pytest.mark.slow
def test_diloco_with_ep_groups_syncs_their_weights(tmp_path):
    """DiLoCo over two groups of 2 ranks at EP 2: the inner steps drift apart, each outer step
    brings every weight, experts included, back to the same values, and averages the expert
    biases each group moved on its own tokens."""
    diloco = ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "3"]
    job = _moe_job(tmp_path, 6, diloco, min_replicas=2)
    job.run_both(timeout=240)
    ours, theirs = job.metrics(0), job.metrics(1)
    assert ours[6]["param_checksum"] == theirs[6]["param_checksum"]
    assert ours[3]["param_checksum"] == theirs[3]["param_checksum"]
    assert ours[5]["param_checksum"] != theirs[5]["param_checksum"]  # inner steps: apart
    final = [_stored(tmp_path / f"replica_{r}", 6)["model"] for r in (0, 1)]
    biases = [{k: v for k, v in f.items() if k.endswith("expert_bias")} for f in final]
    assert biases[0] and biases[0].keys() == biases[1].keys()
    for key, bias in biases[0].items():
        assert torch.equal(bias, biases[1][key]), key
        assert bias.any(), key
