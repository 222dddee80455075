"""The multi-process gloo harness itself: results, failures and timeouts come back."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness.dist import run_ranks


def _allreduce_rank() -> tuple[int, float]:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise KeyError("boom on rank one")
    dist.barrier()


def _hang_on_rank_zero() -> None:
    if dist.get_rank() == 0:
        time.sleep(600)


def _die_on_rank_one() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def test_results_come_back_by_rank():
    assert run_ranks(3, _allreduce_rank) == [(0, 3.0), (1, 3.0), (2, 3.0)]


@pytest.mark.parametrize(
    ("fn", "timeout", "match"),
    [
        (_fail_on_rank_one, 60, "(?s)rank 1:.*KeyError: 'boom on rank one'"),
        (_hang_on_rank_zero, 4, "timed out after 4s"),
        (_die_on_rank_one, 60, "died without a result"),
    ],
)
@pytest.mark.slow
def test_failures_are_reported_and_processes_ended(fn, timeout, match):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=match) as info:
        run_ranks(2, fn, timeout=timeout)
    assert time.monotonic() - start < timeout + 30, info.value
