"""The mixture of experts under DiLoCo, expert parallelism inside each replica group: a real
lighthouse, replica groups of 2 train.py ranks at EP 2. (Its kill and heal under every-step
torchft is the every-step reference job of tests/containers/gate/test_fault_tolerant.py.)"""

from __future__ import annotations

import pytest
import torch

from tests.harness.ftjob import FTJob
from tests.test_reshard import _stored


@pytest.mark.slow
def test_diloco_with_ep_groups_syncs_their_weights(tmp_path):
    """DiLoCo over two groups of 2 ranks at EP 2: the inner steps drift apart, each outer step
    brings every weight, experts included, back to the same values, and averages the expert
    biases each group moved on its own tokens."""
    diloco = ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "3"]
    job = FTJob.moe(tmp_path, 6, diloco, min_replicas=2)
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
