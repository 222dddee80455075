"""`[parallelism] expert_parallel_degree` and `[model] load_balance_coeff`: resolved against
the world, and every layout or family that cannot take them refused in one line before any
process group exists."""

from __future__ import annotations

import re

import pytest

from components.job import validate_job
from components.parallel_dims import ParallelDims
from config import ConfigError, load_job_config

MOE = ["--model.name", "moe"]


def _cfg(*overrides: str):
    return load_job_config(["--training.local_batch_size", "4", *overrides])


def _ep(n: int) -> list[str]:
    return ["--parallelism.expert_parallel_degree", str(n)]


def test_ep_is_carved_out_of_dp_shard_and_ranks_keep_their_coordinates():
    with_ep = validate_job(_cfg(*MOE, *_ep(2)), world_size=4)
    without = validate_job(_cfg(*MOE), world_size=4)
    assert (with_ep.dp_shard, with_ep.ep, with_ep.dp_shard_mod_ep, with_ep.dp) == (4, 2, 2, 4)
    assert without.ep == 1
    for rank in range(4):
        assert with_ep.coordinates(rank) == without.coordinates(rank)
        assert with_ep.dp_rank(rank) == without.dp_rank(rank) == rank
    hsdp = validate_job(
        _cfg(*MOE, *_ep(2), "--parallelism.data_parallel_replicate_degree", "2"), world_size=4
    )
    assert (hsdp.dp_replicate, hsdp.dp_shard, hsdp.dp_shard_mod_ep) == (2, 2, 1)
    assert validate_job(_cfg(*MOE, "--model.load_balance_coeff", "0"), world_size=1).ep == 1


BAD = {
    "ep does not divide dp_shard": (
        [*MOE, *_ep(3)],
        4,
        r"expert_parallel_degree = 3: does not divide data_parallel_shard_degree 4",
    ),
    "ep with tp": (
        [*MOE, *_ep(2), "--parallelism.tensor_parallel_degree", "2"],
        4,
        r"expert_parallel_degree = 2 with tensor_parallel_degree 2",
    ),
    "ep with fsdp1": (
        [*MOE, *_ep(2), "--parallelism.data_parallel_shard_impl", "fsdp1"],
        2,
        r"expert_parallel_degree = 2 with data_parallel_shard_impl = 'fsdp1'",
    ),
    "ep with fp16 reduce over one rank": (
        [*MOE, *_ep(2), "--training.mixed_precision_reduce", "float16"],
        2,
        r"expert_parallel_degree = 2 with \[training\] mixed_precision_reduce = 'float16'",
    ),
    "experts not divisible": (
        [*MOE, *_ep(3)],
        3,
        r"expert_parallel_degree = 3: does not divide the 8 experts of moe flavor 'debug'",
    ),
    "moe with tp": (
        [*MOE, "--parallelism.tensor_parallel_degree", "2"],
        2,
        r"tensor_parallel_degree = 2: the moe family has no tensor-parallel plan",
    ),
    "llama with ep": (_ep(2), 2, r"expert_parallel_degree = 2: the llama family has no experts"),
    "llama with a coeff": (
        ["--model.load_balance_coeff", "0.01"],
        1,
        r"load_balance_coeff = 0.01: the llama family has no experts to balance",
    ),
    "moe flavor": ([*MOE, "--model.flavor", "small"], 1, r"valid moe flavors: tiny, debug"),
    "moe layers": (
        [*MOE, "--model.flavor", "tiny", "--model.num_parts", "3"],
        1,
        r"num_parts = 3: moe flavor 'tiny' has 2 layers",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_what_cannot_run_is_one_config_error_naming_keys_values_and_fix(case):
    overrides, world, message = BAD[case]
    with pytest.raises(ConfigError, match=message) as raised:
        validate_job(_cfg(*overrides), world_size=world)
    line = str(raised.value)
    assert "\n" not in line and re.search(r"\[(parallelism|model)\]", line)
    assert re.search(r"[;:] (use|set|remove|valid)", line)  # the fix


def test_a_negative_coeff_is_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"\[model\] load_balance_coeff = -1"):
        _cfg("--model.load_balance_coeff", "-1")


def test_parallel_dims_defaults_to_no_expert_parallelism():
    assert ParallelDims(1, 1, 2, 1).ep == 1
