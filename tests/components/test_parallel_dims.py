"""`[parallelism]` resolved against the world: degrees, coordinates, stages, and every layout
that cannot run refused in one line before any process group exists."""

from __future__ import annotations

import re

import pytest

from components.job import validate_job
from components.parallel_dims import ParallelDims
from config import ConfigError, load_job_config
from tests.harness.dist import run_here


def _cfg(*overrides: str):
    return load_job_config(["--training.local_batch_size", "4", *overrides])


def test_shard_degree_minus_one_takes_the_ranks_left_and_coordinates_are_row_major():
    cfg = _cfg(
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--model.num_parts",
        "4",
        "--parallelism.pipeline_parallel_schedule",
        "Interleaved1F1B",
    )
    dims = ParallelDims.from_config(cfg, 8)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp) == (2, 1, 2, 2, 2)
    # rank 6 = pp 1, dp_shard 1, tp 0: the second pipeline rank holds stages 1 and 3.
    assert dims.coordinates(6) == {"pp": 1, "dp_replicate": 0, "dp_shard": 1, "tp": 0}
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert dims.stages(6, 4) == [1, 3] and dims.stages(1, 4) == [0, 2]
    hsdp = ParallelDims.from_config(_cfg("--parallelism.data_parallel_replicate_degree", "2"), 4)
    assert [hsdp.dp_rank(r) for r in range(4)] == [0, 1, 2, 3]


PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
INTERLEAVED = ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
BAD = {
    "product": (
        [
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "3",
        ],
        4,
        r"tensor_parallel_degree 2 x data_parallel_shard_degree 3 = 6, not the 4 ranks",
    ),
    "rest": (["--parallelism.tensor_parallel_degree", "3"], 4, r"= 3 does not divide the 4 ranks"),
    "shard 0": (["--parallelism.data_parallel_shard_degree", "0"], 2, r"shard_degree = 0"),
    "parts": ([*PP2, "--model.num_parts", "3"], 2, r"num_parts = 3: not a multiple"),
    "one stage": ([*PP2, "--model.num_parts", "4"], 2, r"'1F1B' runs one stage per rank"),
    "interleaved": (
        [*PP2, *INTERLEAVED],
        2,
        r"'Interleaved1F1B' needs two or more stages per rank",
    ),
    "layers": (
        [*PP2, "--model.flavor", "tiny", "--model.num_parts", "4", *INTERLEAVED],
        2,
        r"num_parts = 4: llama flavor 'tiny' has 2 layers",
    ),
    "microbatch": (
        [*PP2, "--parallelism.pipeline_parallel_microbatch_size", "3"],
        2,
        r"microbatch_size = 3: does not divide \[training\] local_batch_size 4",
    ),
    "too few": (
        [*PP2, "--parallelism.pipeline_parallel_microbatch_size", "4"],
        2,
        r"'1F1B' needs at least 2 micro-batches",
    ),
    "heads": (["--parallelism.tensor_parallel_degree", "3"], 3, r"does not divide the 4 n_heads"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_layout_that_cannot_run_is_one_config_error_naming_keys_and_fix(case):
    overrides, world, message = BAD[case]
    with pytest.raises(ConfigError, match=message) as raised:
        validate_job(_cfg(*overrides), world_size=world)
    line = str(raised.value)
    assert "\n" not in line and re.search(r"\[(parallelism|model)\]", line)
    assert re.search(r"[;:] (use|make|choose|raise)", line)  # the fix


def test_the_launcher_refuses_a_bad_layout_in_one_line_before_any_rank_starts(tmp_path):
    argv = ["--parallelism.tensor_parallel_degree", "3", "--job.dump_folder", str(tmp_path)]
    result = run_here(["--nproc_per_node", "2", *argv])
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "tensor_parallel_degree" in errors[0], result.stderr
    assert not (tmp_path / "run.lock").exists()  # no rank started


def test_fsdp_mixed_precision_needs_a_data_parallel_dim_to_shard():
    """FSDP2 (and so its mixed precision) runs when dp_shard or dp_replicate is above 1; with
    tensor parallelism alone nothing is sharded, and the policy is refused, not ignored."""
    bf16 = ["--training.mixed_precision_param", "bfloat16"]
    assert ParallelDims.from_config(_cfg(*bf16), 2).dp_shard == 2
    hsdp = _cfg(*bf16, "--parallelism.data_parallel_replicate_degree", "2")
    assert ParallelDims.from_config(hsdp, 2).dp_replicate == 2
    with pytest.raises(ConfigError, match=r"mixed_precision_param = 'bfloat16': FSDP2's mixed"):
        ParallelDims.from_config(_cfg(*bf16, "--parallelism.tensor_parallel_degree", "2"), 2)
