"""FTOptimizersContainer on real torchft: a real lighthouse, real replica groups, real kills."""

from __future__ import annotations

import pytest
import torch

from components.ft import build_ft_manager, manager_port
from components.optimizer import build_optimizers
from config import ConfigError, FaultTolerance, load_job_config
from containers import FTOptimizersContainer
from tests.harness.dist import free_port
from tests.harness.ftjob import FTJob
from tests.harness.helpers import (
    assert_same,
    batch,
    forward,
    full,
    load_job_state,
    three_parts,
    train,
)

STEPS, HOLD = 14, 8  # the survivor pauses at step HOLD until the killed group is back


def _up(job: FTJob, replica: int, times: int = 1) -> bool:
    """Whether replica group `replica` has started training `times` times (none from disk)."""
    return job.log(f"replica_{replica}").count("micro-batches/step, from step 0") >= times


def _last(job: FTJob, replica: int) -> int:
    return max(job.metrics(replica), default=0)


def test_kill_a_replica_group_of_2_fsdp_ranks_survivor_commits_restarted_one_heals_identical(
    tmp_path,
):
    """Two replica groups of 2 processes each (FSDP2 over the group): one group is killed,
    the other commits on alone, the restarted group heals from it (shard by shard, not from
    disk: no checkpoint exists before the last step) and both end bitwise identical."""
    job = FTJob(tmp_path, STEPS, nproc=2)
    start, pause = tmp_path / "start", tmp_path / "pause"
    start.touch(), pause.touch()
    hold = ("-m", "tests.harness.faults", "hold", "1", str(start))
    try:
        # Both groups wait at step 1 until both are up, so that neither runs far ahead alone.
        job.start_replica(0, (*hold, "hold", str(HOLD), str(pause)))
        job.start_replica(1, hold)
        job.wait_for("both groups", lambda: all(_up(job, r) for r in (0, 1)))
        start.unlink()
        job.wait_for("2 steps on both groups", lambda: min(_last(job, 0), _last(job, 1)) >= 2)
        job.kill("replica_1")  # its launcher and both of its ranks
        killed_at = _last(job, 0)
        job.wait_for("the survivor alone", lambda: _last(job, 0) == HOLD - 1, 60)
        restarted_at = len(job.log("replica_1"))
        job.start_replica(1)
        # Its ranks are built and about to ask for a quorum: let the survivor go on.
        job.wait_for("the restart", lambda: _up(job, 1, times=2))
        pause.unlink()
        assert job.wait_exit("replica_0") == 0, job.log("replica_0")[-3000:]
        assert job.wait_exit("replica_1") == 0, job.log("replica_1")[-3000:]
    finally:
        job.close()

    survivor, healed = job.metrics(0), job.metrics(1)
    # (The group that asked for its first quorum later heals from the other at step 1.)
    assert sorted(survivor) == list(range(min(survivor), STEPS + 1)) and min(survivor) <= 2
    outage = range(killed_at + 1, HOLD)
    assert len(outage) >= 3 and not set(outage) & set(healed), (killed_at, sorted(healed))
    assert "healed from a peer" in job.log("replica_1")[restarted_at:]
    after_heal = sorted(s for s in healed if s >= HOLD)
    assert len(after_heal) >= 3 and after_heal[-1] == STEPS, after_heal
    # No step was ever committed with differing state, and the LR schedule stayed in step.
    for step in sorted(set(survivor) & set(healed)):
        assert survivor[step]["param_checksum"] == healed[step]["param_checksum"], step
        assert survivor[step]["lr"] == healed[step]["lr"], step
        assert survivor[step]["grad_norm"] == healed[step]["grad_norm"], step

    argv = [*job.args, "--checkpoint.enable"]
    final = [load_job_state(str(tmp_path / f"replica_{r}"), argv, ft=True) for r in (0, 1)]
    assert final[0]["step"] == final[1]["step"] == STEPS
    assert_same(final[0]["model"], final[1]["model"])
    assert_same(final[0]["optim"], final[1]["optim"])
    assert final[0]["lrs"] == final[1]["lrs"]
    assert final[0]["sample_index"] == final[1]["sample_index"]


@pytest.fixture
def manager(tmp_path, monkeypatch):
    """One replica group (this process) with a real lighthouse and a real torchft Manager."""
    job = FTJob(tmp_path, 1)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    cfg = FaultTolerance(
        enable=True,
        lighthouse=f"http://127.0.0.1:{job.port}",
        manager_port=free_port(),
        process_group_timeout_ms=5000,
    )
    ft_manager = build_ft_manager(cfg, 0, 1, torch.device("cpu"))
    yield ft_manager
    ft_manager.shutdown(wait=False)
    job.close()


def test_hooks_fire_once_per_committed_step_and_an_uncommitted_step_changes_nothing(manager):
    parts = three_parts()
    ft = FTOptimizersContainer(parts, torch.optim.AdamW, {"lr": 1e-2}, ft_manager=manager)
    calls = []
    ft.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    ft.register_step_post_hook(lambda o, a, k: calls.append("post"))
    train(parts, ft, 3)
    assert ft.last_step_committed and calls == ["pre", "post"] * 3
    assert manager.current_step() == 3

    before = (
        {k: full(v) for k, v in ft.state_dict().items()},
        [full(p) for m in parts for p in m.parameters()],
    )
    ft.zero_grad()

    forward(parts, batch(99)).square().mean().backward()
    manager.report_error(RuntimeError("a peer died mid-allreduce"))
    ft.step()
    assert not ft.last_step_committed and calls == ["pre", "post"] * 3
    assert_same({k: full(v) for k, v in ft.state_dict().items()}, before[0])
    assert all(
        torch.equal(a, b) for a, b in zip(before[1], (p for m in parts for p in m.parameters()))
    )
    assert manager.current_step() == 3

    train(parts, ft, 1, start=100)  # the next quorum recovers: commits again
    assert ft.last_step_committed and calls == ["pre", "post"] * 4


def test_served_state_is_built_at_serve_time(manager):
    from components.ft import serve_state

    parts = three_parts()
    ft = FTOptimizersContainer(
        parts, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, ft_manager=manager
    )
    serve_state(manager, {"optimizer": ft})
    train(parts, ft, 1)
    for group in ft.param_groups:
        group["lr"] = 0.05  # a scheduler's change after the state was first read
    served = manager._manager_state_dict()["user"]["train"]["optimizer"]
    assert served["param_groups.head.weight.lr"] == 0.05
    assert (
        served["state.head.weight.momentum_buffer"]
        is ft.state_dict()["state.head.weight.momentum_buffer"]
    )


def test_builder_wiring_and_refusals(monkeypatch):
    with pytest.raises(ConfigError, match=r"container = 'fault_tolerant': needs a torchft manager"):
        load_job_config(["--optimizer.container", "fault_tolerant"])
    cfg = load_job_config(["--optimizer.container", "fault_tolerant", "--fault_tolerance.enable"])
    with pytest.raises(ConfigError, match=r"container = 'fault_tolerant': needs a torchft manager"):
        build_optimizers(three_parts(), cfg.optimizer)  # no gate handed over
    with pytest.raises(ConfigError, match=r"replica_id = 2: must be below group_size = 2"):
        load_job_config(
            [
                "--fault_tolerance.enable",
                "--fault_tolerance.replica_id",
                "2",
                "--fault_tolerance.group_size",
                "2",
            ]
        )
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match="no lighthouse address"):
        build_ft_manager(FaultTolerance(enable=True), 0, 1, torch.device("cpu"))
    assert build_ft_manager(FaultTolerance(), 0, 1, torch.device("cpu")) is None
    assert manager_port(FaultTolerance(replica_id=3)) == 29603
    assert manager_port(FaultTolerance(replica_id=3, manager_port=4000)) == 4000


def test_a_replica_group_without_a_live_peer_resumes_from_disk(tmp_path):
    job = FTJob(tmp_path, 12, ["--fault_tolerance.group_size", "1", "--checkpoint.interval", "6"])
    try:
        for steps in ("6", "12"):  # the second run finds no peer: only its disk checkpoint
            job.args[job.args.index("--training.steps") + 1] = steps
            job.start_replica(0)
            assert job.wait_exit("replica_0", 120) == 0, job.log("replica_0")[-3000:]
    finally:
        job.close()
    assert "resumed from" in job.log("replica_0") and "step-6" in job.log("replica_0")
    assert sorted(job.metrics(0)) == list(range(1, 13))
    state = load_job_state(str(tmp_path / "replica_0"), [*job.args, "--checkpoint.enable"], ft=True)
    assert state["step"] == 12 and state["sched"] == 12
