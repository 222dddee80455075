"""components/comm.py: what a rank says when a collective fails, and when it stays silent.

The collective is real (2 gloo ranks, one exits before the other's all-reduce); the error
files are laid out as torchelastic lays them out for its workers."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from components.comm import _a_peer_spoke, collective_failure
from tests.harness.dist import run_ranks


def _rank_0_exits_first() -> tuple[str, bool] | None:
    """Rank 0 leaves once the group is up (it holds the store the group met through); rank
    1's next all-reduce meets a peer that is gone."""
    dist.barrier()
    if dist.get_rank() == 0:
        os._exit(0)  # as a rank that failed and exited does: no goodbye to the group
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as e:
        failure = collective_failure(e)
        return None if failure is None else (failure.line, failure.timed_out)
    return ("the all-reduce succeeded without its peer", False)


def test_a_peer_that_exited_first_is_named_as_gone_not_as_a_timeout():
    ranks = run_ranks(2, _rank_0_exits_first, ends_all=lambda got: got is not None)
    line, timed_out = next(r for r in ranks if r is not None)
    assert not timed_out, line
    assert "lost a peer: another rank exited first (its log has the cause)" in line, line


def test_a_rank_waits_for_a_peers_error_file_within_the_grace_only(tmp_path, monkeypatch):
    """torchelastic gives each worker <run>/attempt_<n>/<local_rank>/error.json: a peer's file
    is seen at once; none, and the wait ends at its bound."""
    own = tmp_path / "attempt_0" / "1" / "error.json"
    own.parent.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(own))
    start = time.monotonic()
    assert not _a_peer_spoke(0.2)  # its own folder only: no peer spoke
    assert 0.2 <= time.monotonic() - start < 30
    peer = Path(tmp_path, "attempt_0", "0", "error.json")
    peer.parent.mkdir()
    peer.write_text("{}")
    assert _a_peer_spoke(60)  # at once, not after the grace
