"""FTOptimizersContainer on real torchft: a real lighthouse, real replica groups, real kills."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time

import pytest
import torch

from components.ft import build_ft_manager, manager_port
from components.optimizer import build_optimizers
from config import ConfigError, FaultTolerance, load_job_config
from containers import (
    FTOptimizersContainer,
    MixedPrecisionOptimizersContainer,
    MixedPrecisionSettings,
    OptimizersContainer,
    TorchFTGate,
)
from tests.harness.dist import free_port, launch
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


def _kill_and_heal(
    job: FTJob,
    hold: int,
    kill_after: int,
    faults: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] = ((), (), ()),
) -> tuple[dict, dict, int, int]:
    """Run groups 0 and 1 together (both wait at step 1 until both are up, so that neither runs
    far ahead alone), kill group 1 once both passed step `kill_after`, let group 0 commit alone
    up to step `hold` - 1, restart group 1 and let it heal. `faults`: tests.harness.faults
    arguments of group 0, of group 1, of the restarted group 1. Returns both groups' metrics
    by step, the step group 0 had reached when group 1 was killed, and where the restarted
    group's log begins."""
    start, pause = job.folder / "start", job.folder / "pause"
    start.touch(), pause.touch()
    first = ("-m", "tests.harness.faults", "hold", "1", str(start))
    try:
        job.start_replica(0, (*first, *faults[0], "hold", str(hold), str(pause)))
        job.start_replica(1, (*first, *faults[1]))
        job.wait_for("both groups", lambda: all(_up(job, r) for r in (0, 1)))
        start.unlink()
        job.wait_for(
            f"step {kill_after} on both groups",
            lambda: min(_last(job, 0), _last(job, 1)) >= kill_after,
        )
        job.kill("replica_1")  # its launcher and every rank of it
        killed_at = _last(job, 0)
        job.wait_for("the survivor alone", lambda: _last(job, 0) == hold - 1, 60)
        restarted_at = len(job.log("replica_1"))
        job.start_replica(1, ("-m", "tests.harness.faults", *faults[2]))
        # Its ranks are built and about to ask for a quorum: let the survivor go on.
        job.wait_for("the restart", lambda: _up(job, 1, times=2))
        pause.unlink()
        assert job.wait_exit("replica_0") == 0, job.log("replica_0")[-3000:]
        assert job.wait_exit("replica_1") == 0, job.log("replica_1")[-3000:]
    finally:
        job.close()
    survivor, healed = job.metrics(0), job.metrics(1)
    # (The group that asked for its first quorum later heals from the other at step 1.)
    assert sorted(survivor) == list(range(min(survivor), job.steps + 1)) and min(survivor) <= 2
    assert not set(range(killed_at + 1, hold)) & set(healed), (killed_at, sorted(healed))
    assert "healed from a peer" in job.log("replica_1")[restarted_at:]
    # A peer's death is at most one line on the survivor (no torchft traceback), and no
    # flight-recorder warnings on a CPU.
    assert "Traceback" not in job.log("replica_0"), job.log("replica_0")[-3000:]
    assert "flight recorder" not in job.log("replica_0") + job.log("replica_1")
    return survivor, healed, killed_at, restarted_at


def _final_states(job: FTJob) -> list[dict]:
    """Both groups' last checkpoints, after asserting they are bitwise equal."""
    argv = [*job.args, "--checkpoint.enable"]
    final = [load_job_state(str(job.folder / f"replica_{r}"), argv, ft=True) for r in (0, 1)]
    assert final[0]["step"] == final[1]["step"] == job.steps
    assert_same(final[0]["model"], final[1]["model"])
    assert_same(final[0]["optim"], final[1]["optim"])
    assert final[0]["lrs"] == final[1]["lrs"]
    assert final[0]["sample_index"] == final[1]["sample_index"]
    return final


@pytest.mark.slow
def test_every_step_reference_job_ep_groups_lean_precision_kill_heal_identical(tmp_path):
    """The every-step reference job. Two replica groups of 2 ranks each: the tiny mixture of
    experts at EP 2 (FSDP2 over the dense weights), the lean mixed precision (bf16
    parameters, their masters kept as remainders, AdamW with bf16 moments). Group 1 is
    killed, group 0 commits on alone, the restarted group heals from it (shard by shard, not
    from disk: no checkpoint exists before the last step; its moments stay bf16, its masters
    exact). Every step both committed is the same on both: weights, lr, grad norm and the
    load-balancing counts (summed over the groups of each quorum); the healed step's row says
    why it has no loss; both end bitwise identical, expert biases included."""
    lean = [
        *("--optimizer.container", "mixed_precision", "--optimizer.moment_dtype", "bfloat16"),
        "--mixed_precision.store_param_remainders",
    ]
    job = FTJob.moe(tmp_path, STEPS, lean)
    survivor, healed, killed_at, restarted_at = _kill_and_heal(job, HOLD, kill_after=2)
    assert HOLD - killed_at > 3, killed_at
    after_heal = sorted(s for s in healed if s >= HOLD)
    assert len(after_heal) >= 3 and after_heal[-1] == STEPS, after_heal
    # No step was ever committed with differing state, and the LR schedule stayed in step.
    for step in sorted(set(survivor) & set(healed)):
        for key in ("param_checksum", "lr", "grad_norm", "load_imbalance"):
            assert survivor[step][key] == healed[step][key], (step, key)
    step = job.healed_row(restarted_at, survivor, healed)
    # The average it applied (its own share zero while healing): the step's own grad norm.
    assert healed[step]["grad_norm"] == survivor[step]["grad_norm"]

    job.args += ["--parallelism.expert_parallel_degree", "1"]  # read back in one process
    model, optim = (_final_states(job)[1][k] for k in ("model", "optim"))
    moments = [v for k, v in optim.items() if k.endswith(("exp_avg", "exp_avg_sq"))]
    assert moments and {v.dtype for v in moments} == {torch.bfloat16}
    assert any(k.startswith("master_weights.") for k in optim)
    biases = [v for k, v in model.items() if k.endswith("moe.expert_bias")]
    assert biases and any(b.any() for b in biases)  # (equal on both groups: _final_states)
    assert any(k.startswith("load_balance.") for k in optim)


# fp16 with dynamic scaling: one overflow halves the scale (hysteresis 1), 6 clean steps in a
# row double it. The group restarted at step 7 or 8 starts at 1024 with no clean steps; it
# must take its peer's 512 and count of clean steps (the scale grows at step 9).
FP16 = [
    "--optimizer.container", "mixed_precision",
    "--mixed_precision.param_dtype", "float16",
    "--mixed_precision.loss_scaling", "dynamic",
    "--mixed_precision.initial_scale", "1024",
    "--mixed_precision.hysteresis", "1",
    "--mixed_precision.growth_interval", "6",
]  # fmt: skip
# (Not at step 2: the group that joins later heals at step 1, and its next step is 3.)
MP_STEPS, MP_HOLD, OVERFLOW, HEALED_OVERFLOW = 12, 7, 3, 10
SCALES = [1024.0] * 2 + [512.0] * 6 + [1024.0] + [512.0] * 3  # steps 1..12


@pytest.mark.slow
def test_mixed_precision_overflow_on_one_group_skips_on_both_and_a_killed_group_heals_scaler(
    tmp_path,
):
    """Two one-process replica groups, fp16 with fp32 masters: an overflow injected into the
    gradients of group 1 alone is skipped by both groups, whose scales halve alike; group 1 is
    killed, the survivor commits on, the restarted group heals (masters, scaler and the EMA of
    the masters from its peer) and overflows again alone; both groups end bitwise equal, scaler
    and EMA included (skipped steps did not count: 12 steps, 2 skipped)."""
    job = FTJob(tmp_path, MP_STEPS, [*FP16, "--ema.enable", "--ema.decay", "0.5"])
    overflow, healed_overflow = ("overflow", str(OVERFLOW)), ("overflow", str(HEALED_OVERFLOW))
    survivor, healed, _, _ = _kill_and_heal(
        job, MP_HOLD, kill_after=OVERFLOW + 1, faults=((), overflow, healed_overflow)
    )
    assert {OVERFLOW, HEALED_OVERFLOW} <= set(survivor) & set(healed)
    for metrics, name in ((survivor, "replica_0"), (healed, "replica_1")):
        # Skipped on both groups, the scale halved on both, then it grew on both alike.
        for step in (OVERFLOW, HEALED_OVERFLOW):
            assert f"step {step} skipped: non-finite" in job.log(name), (name, step)
        skips = [(s >= OVERFLOW) + (s >= HEALED_OVERFLOW) for s in sorted(metrics)]
        assert [metrics[s]["skipped_steps"] for s in sorted(metrics)] == skips, name
        assert [metrics[s]["loss_scale"] for s in sorted(metrics)] == [
            SCALES[s - 1] for s in sorted(metrics)
        ], name
    for step in sorted(set(survivor) & set(healed)):
        for key in ("param_checksum", "loss_scale", "grad_norm", "skipped_steps", "lr"):
            assert survivor[step].get(key) == healed[step].get(key), (step, key)

    final = _final_states(job)  # masters and loss_scaler.* included
    assert any(k.startswith("master_weights.") for k in final[0]["optim"])
    assert final[0]["optim"]["loss_scaler.scale"] == survivor[MP_STEPS]["loss_scale"]
    assert final[0]["optim"]["ema.steps"] == MP_STEPS - 2
    assert "ema.layers.0.attention.wq.weight" in final[0]["optim"]


@contextlib.contextmanager
def one_group(tmp_path, monkeypatch, **settings):
    """One replica group (this process) with a real lighthouse and a real torchft Manager
    (built as train.py builds it, from `[fault_tolerance]` `settings`)."""
    job = FTJob(tmp_path, 1)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    cfg = FaultTolerance(
        enable=True,
        lighthouse=f"http://127.0.0.1:{job.port}",
        manager_port=0,  # (torchft binds a free one)
        process_group_timeout_ms=5000,
        **settings,
    )
    ft_manager = build_ft_manager(cfg, 0, 1, torch.device("cpu"))
    try:
        yield ft_manager
    finally:
        ft_manager.shutdown(wait=False)
        job.close()


@pytest.fixture
def manager(tmp_path, monkeypatch):
    with one_group(tmp_path, monkeypatch) as ft_manager:
        yield ft_manager


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


def test_a_lone_replica_group_skips_the_average_and_steps_as_without_torchft(manager):
    calls = []
    allreduce = manager.allreduce  # the real one, counted
    manager.allreduce = lambda *a, **k: calls.append(1) or allreduce(*a, **k)
    ft_parts, parts = three_parts(), three_parts()
    kw = {"lr": 1e-2}
    ft = FTOptimizersContainer(ft_parts, torch.optim.AdamW, kw, ft_manager=manager, max_norm=0.1)
    plain = OptimizersContainer(parts, torch.optim.AdamW, kw, max_norm=0.1)
    train(ft_parts, ft, 3)
    train(parts, plain, 3)
    assert ft.last_step_committed and manager.current_step() == 3
    assert calls == []  # the average over one group is its own gradients: no collective
    assert_same(ft.state_dict(), plain.state_dict())
    for a, b in zip(ft_parts, parts):
        assert_same(a.state_dict(), b.state_dict())


def test_mixed_precision_under_the_gate_only_committed_steps_reach_the_scaler_and_hooks(manager):
    parts = [p.to(torch.float16) for p in three_parts()]
    settings = MixedPrecisionSettings(
        param_dtype="float16",
        loss_scaling="dynamic",
        initial_scale=1024.0,
        hysteresis=1,
        growth_interval=2,
    )
    mp = MixedPrecisionOptimizersContainer(
        parts, torch.optim.AdamW, {"lr": 1e-2}, settings=settings, gate=TorchFTGate(manager)
    )
    calls = []
    mp.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    mp.register_step_post_hook(lambda o, a, k: calls.append("post"))

    def step(i: int, bad: float = 1.0, error: bool = False) -> None:
        mp.zero_grad()
        mp.backward(forward(parts, batch(i).half()).float().square().mean() * bad)
        if error:
            manager.report_error(RuntimeError("a peer died mid-allreduce"))
        mp.step()

    step(0), step(1)
    assert calls == ["pre", "post"] * 2 and mp.loss_scale == 2048.0  # grew after 2 clean steps
    before = _state(parts, mp)
    # Not committed (an overflow too): nothing changes, the scaler included.
    step(2, bad=math.inf, error=True)
    assert not mp.last_step_committed and not mp.last_report.nonfinite
    assert_same(_state(parts, mp), before)
    assert manager.current_step() == 2 and calls == ["pre", "post"] * 2
    # Committed by torchft but non-finite: skipped, no hooks; only the scale backs off.
    step(3, bad=math.inf)
    assert mp.last_report.nonfinite and manager.current_step() == 3
    after = _state(parts, mp)
    assert after.pop("loss_scaler.scale") == 1024.0 and before.pop("loss_scaler.scale") == 2048.0
    assert_same(after, before)
    assert calls == ["pre", "post"] * 2
    step(4)
    assert mp.last_step_committed and calls == ["pre", "post"] * 3


def _state(parts, container) -> dict:
    """Flat optimizer state (masters and scaler included) and the model's parameters."""
    params = {f"param.{i}": full(p) for i, p in enumerate(p for m in parts for p in m.parameters())}
    return {**{k: full(v) for k, v in container.state_dict().items()}, **params}


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


@pytest.mark.slow
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


def _errors(log: str) -> list[str]:
    """The lines of a group's log that say why it stopped, and any traceback's."""
    said = ("error:", "Traceback")
    return [
        line
        for line in log.splitlines()
        if any(s in line for s in said) or (" ERROR " in line and "stopped at" in line)
    ]


@pytest.mark.slow
def test_a_group_started_with_another_lr_and_clip_is_refused_in_one_line_the_live_one_trains_on(
    tmp_path,
):
    """Group 0 trains (held at step 4 until group 1 is up); group 1 starts with another lr
    and max_norm: when it joins it is refused, naming both keys and both values, before it
    loads or commits anything (exit 2); group 0 commits every step and says so once."""
    job = FTJob(tmp_path, 10, nproc=2, join_timeout_ms=60_000)  # they surely meet
    codes = job.join_late(4, ["--optimizer.lr", "1e-3", "--training.max_norm", "0.5"])
    assert codes == (0, 2), job.tails()
    [line] = _errors(job.log("replica_1"))
    assert "error: replica group replica_1 refused before it committed anything" in line
    assert "[optimizer] lr = 0.001 (replica_0: 0.003)" in line, line
    assert "[training] max_norm = 0.5 (replica_0: 1.0)" in line, line
    assert "healed" not in job.log("replica_1")
    assert not job.metrics(1) and not list((tmp_path / "replica_1").glob("checkpoint/step-*"))
    assert sorted(job.metrics(0)) == list(range(1, 11))
    assert job.log("replica_0").count("replica group replica_1 refused") == 1
    assert job.log("replica_0").count("; training on without it") == 1  # and it did
    assert not _errors(job.log("replica_0"))


@pytest.mark.slow
def test_a_survivor_whose_peer_was_refused_names_the_lighthouse_waiting_for_min_replicas(
    tmp_path,
):
    """A lighthouse that needs 2 replica groups; group 1 starts with another lr and is
    refused at the first quorum. Group 0 does not claim to train on without it: it says the
    lighthouse needs min_replicas 2 with 1 group left. Its next quorum warns after the 2 s
    connect timeout and fails after the 6 s quorum timeout, both quoting the lighthouse,
    which is up: waiting for min_replicas 2 with 1 joined, and what to do; never a
    lighthouse "gone or unreachable"."""
    timeouts = ["--fault_tolerance.quorum_timeout_ms", "6000"]
    timeouts += ["--fault_tolerance.connect_timeout_ms", "2000"]
    job = FTJob(tmp_path, 10, timeouts, min_replicas=2)
    try:
        job.start_replica(0)
        job.args += ["--optimizer.lr", "1e-3"]
        job.start_replica(1)
        codes = [job.wait_exit(f"replica_{r}", 60) for r in (0, 1)]
    finally:
        job.close()
    assert codes == [1, 2], job.tails()
    log = job.log("replica_0")
    [refused] = [line for line in log.splitlines() if "replica group replica_1 refused" in line]
    assert "training on without it" not in refused, refused
    assert (
        "[optimizer] lr = 0.001 (replica_0: 0.003)); the lighthouse needs min_replicas 2 "
        "replica groups for a quorum and 1 replica group is left: no quorum until another "
        "joins (waiting up to the quorum timeout, 6 s, then stopping); start one with "
        "replica_0's config, or restart the lighthouse with --min_replicas 1"
    ) in refused, refused
    lighthouse = (
        f"the lighthouse at http://127.0.0.1:{job.port} is up and waits for min_replicas 2 "
        'replica groups, 1 joined (it says: "New quorum not ready, only have 1 participants, '
        "need min_replicas 2 ["
    )
    advice = "start another replica group, or restart the lighthouse with --min_replicas 1"
    [line] = _errors(log)
    assert "stopped at step 1 of 10: torchft found no quorum of replica groups " in line
    assert f"within 6 s (TimeoutError): {lighthouse}" in line and advice in line, line
    [warned] = [x for x in log.splitlines() if "no quorum of replica groups after 2 s" in x]
    assert lighthouse in warned and advice in warned, warned
    assert "gone or unreachable" not in log


@pytest.mark.slow
def test_a_rank_late_to_the_commit_within_the_quorum_timeout_is_waited_for(tmp_path):
    """Rank 1 of a 2-rank group reaches step 2's commit 7 s late (as a rank still configuring
    the quorum's process group after a stale peer address does): past the 5 s process-group
    timeout, within the 20 s quorum timeout. Rank 0 waits for it and the step commits;
    with torchft's default commit deadline (the process-group timeout) rank 0 crashed."""
    job = FTJob(tmp_path, 3, ["--fault_tolerance.quorum_timeout_ms", "20000"], nproc=2)
    try:
        job.start_replica(0, ("-m", "tests.harness.faults", "lag", "2", "1", "7"))
        assert job.wait_exit("replica_0", 120) == 0, job.log("replica_0")[-3000:]
    finally:
        job.close()
    assert sorted(job.metrics(0)) == [1, 2, 3]
    assert job.metrics(0)[2]["step_time_s"] > 6  # the lag happened
    assert "Traceback" not in job.log("replica_0") and "not committed" not in job.log("replica_0")


@pytest.mark.slow
def test_a_lighthouse_restarted_on_its_port_is_waited_for_and_one_gone_for_good_ends_in_a_save(
    tmp_path,
):
    """A lighthouse that needs both groups (as its operator runs it for a 2-group job: a
    restarted lighthouse knows no group, and with 1 the first to reach it trains on alone) is
    killed at step >= 3 and started again 1 s later: both groups wait and train on in
    lockstep, neither heals. Killed again for good: after the 2 s connect timeout each group
    says so in one warning, and past the 6 s quorum timeout it saves the step it reached
    and exits 1 with one line, no traceback."""
    timeouts = ["--fault_tolerance.quorum_timeout_ms", "6000"]
    timeouts += ["--fault_tolerance.connect_timeout_ms", "2000"]
    job = FTJob(
        tmp_path,
        400,
        [*timeouts, "--checkpoint.enable"],
        nproc=2,
        min_replicas=2,
    )
    start = tmp_path / "start"
    start.touch()
    try:
        for r in (0, 1):  # both wait at step 1 until both are up (as in _kill_and_heal)
            job.start_replica(r, ("-m", "tests.harness.faults", "hold", "1", str(start)))
        job.wait_for("both groups", lambda: all(_up(job, r) for r in (0, 1)))
        start.unlink()
        job.wait_for("step 3 on both", lambda: min(_last(job, 0), _last(job, 1)) >= 3)
        job.kill("lighthouse")
        down_at = max(_last(job, 0), _last(job, 1))
        time.sleep(1)
        back = [len(job.log(f"replica_{r}")) for r in (0, 1)]
        job.start_lighthouse()
        job.wait_for("5 more steps", lambda: min(_last(job, 0), _last(job, 1)) >= down_at + 5)
        job.kill("lighthouse")
        gone = [len(job.log(f"replica_{r}")) for r in (0, 1)]
        codes = [job.wait_exit(f"replica_{r}", 60) for r in (0, 1)]
    finally:
        job.close()
    assert codes == [1, 1], [job.log(f"replica_{r}")[-3000:] for r in (0, 1)]
    for r in (0, 1):
        reached = _last(job, r)
        assert "healed" not in job.log(f"replica_{r}")[back[r] : gone[r]]
        after = job.log(f"replica_{r}")[gone[r] :]
        [line] = _errors(after)
        assert f"stopped at step {reached} of 400: torchft found no quorum" in line, line
        warned = after[: after.index(line)]
        assert f"WARNING [group {r}] torchft: no quorum of replica groups after 2 s" in warned
        assert "within 6 s" in line and "saved in" in line, line
        address = f"http://127.0.0.1:{job.port}"
        assert f"the lighthouse at {address} does not answer: it is gone or unreachable" in line
        assert (tmp_path / f"replica_{r}" / "checkpoint" / f"step-{reached}").is_dir()
    survivor, other = job.metrics(0), job.metrics(1)
    common = sorted(set(survivor) & set(other))
    assert common[-1] > down_at + 4 and common[-1] <= job.steps
    assert set(range(down_at, common[-1] + 1)) <= set(common)  # lockstep: no step alone
    for step in common:
        assert survivor[step]["param_checksum"] == other[step]["param_checksum"], step


@pytest.mark.slow
def test_no_lighthouse_is_one_line_within_the_connect_timeout(tmp_path):
    port = free_port()  # nothing listens there
    args = ["--job.config_file", "config/debug.toml", "--job.dump_folder", str(tmp_path)]
    args += ["--fault_tolerance.enable", "--fault_tolerance.lighthouse", f"http://127.0.0.1:{port}"]
    args += ["--fault_tolerance.connect_timeout_ms", "1000", "--nproc_per_node", "2"]
    result = launch(0, args, timeout=120)  # train.py's own launcher, 2 ranks
    assert result.returncode == 2, result.stdout[-3000:]
    [line] = [x for x in result.stdout.splitlines() if "error:" in x or "Traceback" in x]
    assert f"lighthouse = 'http://127.0.0.1:{port}': no lighthouse answered within " in line
    assert "connect_timeout_ms = 1000; start it first" in line, line


def test_a_users_own_loop_with_a_plain_lambda_lr_heals_bitwise(tmp_path):
    """torch's load contract under torchft: a user's loop (no train.py, no project scheduler)
    with a plain `LambdaLR`; the group killed after step 2 restarts fresh (lr 1e-2) and heals
    from the survivor at step 6 or later: its first step runs at the survivor's lr, and both
    groups' weights stay bitwise equal to the end (so the healed 8-bit moments, codes and
    scales, are the survivor's)."""
    job = FTJob(tmp_path, 1)
    both, hold = tmp_path / "both", tmp_path / "hold"
    both.touch(), hold.touch()

    def start(replica: int, *extra: str) -> None:
        address = f"http://127.0.0.1:{job.port}"
        args = [str(replica), address, "10", str(tmp_path), *extra]
        job.start_module(f"replica_{replica}", "tests.harness.plain_ft", args)

    def rows(replica: int) -> dict[int, dict]:
        path = tmp_path / f"replica_{replica}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return {row["step"]: row for row in map(json.loads, lines)}

    try:
        start(0, "hold", "1", str(both), "hold", "6", str(hold))
        start(1, "hold", "1", str(both), "die", "2")
        job.wait_for("both groups", lambda: all((tmp_path / f"ready_{r}").exists() for r in (0, 1)))
        both.unlink()
        assert job.wait_exit("replica_1", 120) == 3, job.log("replica_1")[-3000:]
        job.killed.add("replica_1")
        job.wait_for("the survivor alone up to step 5", lambda: max(rows(0), default=0) == 5)
        (tmp_path / "ready_1").unlink()
        start(1)
        job.wait_for("the restarted group", (tmp_path / "ready_1").exists)
        hold.unlink()
        for replica in (0, 1):
            assert job.wait_exit(f"replica_{replica}", 120) == 0, job.log(f"replica_{replica}")
    finally:
        job.close()
    survivor, healed = rows(0), rows(1)
    assert sorted(survivor) == list(range(1, 11))
    after = sorted(s for s in healed if s > 2)
    assert after and after[0] >= 6 and after[-1] == 10, sorted(healed)
    for step in sorted(healed):
        assert healed[step]["lr"] == survivor[step]["lr"] == pytest.approx(1e-2 * 0.7 ** (step - 1))
        assert healed[step]["params"] == survivor[step]["params"], step


def _served_and_sent() -> tuple[dict, dict]:
    import io

    import torch.distributed as dist
    from torch.distributed._serialization import _streaming_load, _streaming_save
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from components.ft import _picklable
    from containers import MasterWeights

    precision = MasterWeights(MixedPrecisionSettings(loss_scaling="none"))
    parts = [precision.cast_model(p) for p in three_parts()]
    for part in parts:
        fully_shard(part, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    kwargs = {"lr": 1e-2, "fused": True}  # flat buffers: the state entries are views of them
    mp = MixedPrecisionOptimizersContainer(parts, torch.optim.AdamW, kwargs, precision=precision)
    mp.zero_grad()
    forward(parts, batch(0, dist.get_rank()).bfloat16()).float().square().mean().backward()
    mp.step()
    buffer = io.BytesIO()
    _streaming_save(_picklable({"optimizer": mp.state_dict()}), buffer)  # as torchft sends it
    buffer.seek(0)
    sent = _streaming_load(buffer, weights_only=False)["optimizer"]
    return {k: full(v) for k, v in mp.state_dict().items()}, {k: full(v) for k, v in sent.items()}


def test_the_served_state_of_fsdp2_mixed_precision_pickles_as_torchft_sends_it():
    """The flat buffers' state views are DTensors over views at a storage offset, which
    torch cannot pickle (it takes them for plain tensors); the served state re-makes them."""
    from tests.harness.dist import run_ranks

    here, sent = run_ranks(2, _served_and_sent)[0]
    assert_same(sent, here)


def _stopped(job: FTJob, sig: int | None = signal.SIGTERM) -> tuple[int, float]:
    """Send `sig` (None: none) to replica group 0; its exit code and the seconds it took."""
    start = time.monotonic()
    if sig is not None:
        os.kill(job.procs["replica_0"].pid, sig)
    code = job.wait_exit("replica_0", timeout=60)
    return code, time.monotonic() - start


@pytest.mark.slow
def test_a_group_that_cannot_commit_obeys_a_stop_within_seconds_or_stops_at_its_timeout(
    tmp_path,
):
    """A lone replica group of a job that needs two to commit retries its first step: a
    SIGTERM ends it within seconds (exit 0, said in one line), and without one it stops at
    `uncommitted_timeout_ms` (exit 1, one line naming the key)."""
    need_two = ["--fault_tolerance.min_replica_size", "2", "--checkpoint.enable"]
    for case, extra in (
        ("signal", []),
        ("timeout", ["--fault_tolerance.uncommitted_timeout_ms", "3000"]),
    ):
        (tmp_path / case).mkdir()
        job = FTJob(tmp_path / case, 20, [*need_two, *extra])
        try:
            job.start_replica(0)
            job.wait_for("a retry", lambda j=job: "was not committed" in j.log("replica_0"))
            code, seconds = _stopped(job, signal.SIGTERM if case == "signal" else None)
        finally:
            job.close()
        log = job.log("replica_0")
        if case == "signal":
            assert code == 0 and seconds < 10, (code, seconds, log[-3000:])
            assert (
                "stopped by SIGTERM while step 1 was not committed; no step was committed: " in log
            )
        else:
            assert code == 1, log[-3000:]
            assert "step 1 was not committed for " in log
            assert "[fault_tolerance] uncommitted_timeout_ms = 3000: too few replica groups" in log


@pytest.mark.slow
def test_a_stop_that_cannot_save_within_its_grace_says_so_and_exits(tmp_path):
    """A lone group waits for a quorum the lighthouse forms only with two: a SIGTERM cannot
    be acted on until the wait ends, so after `stop_grace_seconds` the run says what the
    newest checkpoint holds and exits 1, before a scheduler's SIGKILL."""
    job = FTJob(tmp_path, 20, ["--training.stop_grace_seconds", "3", "--checkpoint.enable"],
                min_replicas=2)  # fmt: skip
    try:
        job.start_replica(0)
        job.wait_for("the start line", lambda: "micro-batches/step" in job.log("replica_0"))
        time.sleep(1.0)  # inside the first quorum's wait
        code, seconds = _stopped(job)
    finally:
        job.close()
    log = job.log("replica_0")
    assert code == 1 and 2.5 < seconds < 10, (code, seconds, log[-3000:])
    assert (
        "stopped by SIGTERM 3 s ago and still not exited ([training] stop_grace_seconds = 3" in log
    )
    assert "no checkpoint in " in log and "nothing saved; exiting now with 1" in log


@pytest.mark.slow
def test_a_group_left_alone_after_committed_steps_saves_the_last_on_a_stop(tmp_path):
    """The issue's case: two groups that must both commit; group 1 is killed after a few
    steps and group 0 retries its next step. A SIGTERM saves the last committed step (the
    data at the uncommitted step's start) and exits 0 within seconds; the same command
    resumes from it."""
    from components.checkpoint import complete_checkpoints

    need_two = ["--fault_tolerance.min_replica_size", "2", "--checkpoint.enable"]
    job = FTJob(tmp_path, 40, need_two)
    try:
        job.start_replica(0)
        job.start_replica(1)
        job.wait_for("3 committed steps", lambda: len(job.metrics(0)) >= 3)
        job.kill("replica_1")
        job.wait_for("a retry", lambda: "was not committed" in job.log("replica_0"))
        committed = max(job.metrics(0))
        code, seconds = _stopped(job)
    finally:
        job.close()
    log = job.log("replica_0")
    assert code == 0 and seconds < 10, (code, seconds, log[-3000:])
    folder = tmp_path / "replica_0" / "checkpoint"
    assert list(complete_checkpoints(folder)) == [committed], log[-3000:]
    assert (
        f"stopped by SIGTERM while step {committed + 1} was not committed; step {committed} "
        f"saved in {folder}, the same command resumes"
    ) in log
