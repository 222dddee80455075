"""LoopPolicy: an uncommitted step runs again on its batches, skips count into a streak that
stops the run, a stop signal stops it after a save, a lost gate exits 1."""

from __future__ import annotations

import logging
import signal
from types import SimpleNamespace
from typing import Any

import torch

from components.checkpoint import TrainState
from components.loop import LoopPolicy
from config import load_job_config
from containers import GateLost, StepReport


class _Checkpoint:
    folder = "/run/checkpoint"

    def __init__(self) -> None:
        self.saves: list[tuple[int, bool]] = []

    def maybe_save(self, step: int, force: bool = False, skipped: bool = False) -> None:
        self.saves.append((step, force))

    def kept(self) -> list[int]:
        return [3]


class _Schedules:
    steps = 0

    def step(self) -> None:
        self.steps += 1


class _Data:
    """An endless loader whose micro-batch i holds i, its position checkpointed (as the
    `Dataloader` protocol asks)."""

    def __init__(self) -> None:
        self.index = 0

    def __iter__(self) -> _Data:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.index += 1
        return torch.tensor([self.index - 1]), torch.tensor([self.index - 1])

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.index = state["index"]


def _policy(*args: str, signal_name: str | None = None) -> tuple[LoopPolicy, Any]:
    cfg = load_job_config(["--training.steps", "10", *args])
    job = SimpleNamespace(
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
        train_state=TrainState(),
        dataloader=_Data(),
        accumulation_steps=2,
        checkpoint=_Checkpoint(),
        lr_schedulers=_Schedules(),
        loss_ranks=1,
        heals=None,  # no torchft: nothing heals
    )
    stop = SimpleNamespace(signal=signal.Signals[signal_name] if signal_name else None)
    stop.requested = signal_name is not None
    return LoopPolicy(job, cfg, stop), job  # type: ignore[arg-type]


def test_an_uncommitted_step_runs_again_on_its_batches_then_counts(caplog):
    loop, job = _policy()
    loop.agree_to_start()
    assert loop.running()
    first = list(loop.batches())
    assert [int(x) for x, _ in first] == [0, 1]
    with caplog.at_level(logging.WARNING):
        assert loop.retry(StepReport(committed=False, skipped="no quorum"))
    assert "step 1 was not committed (no quorum); running it again on the same batch" in caplog.text
    assert list(loop.batches()) == first  # the same tensors, not read again
    assert not loop.retry(StepReport())
    loop.count(StepReport())
    assert job.train_state.step == 1 and job.lr_schedulers.steps == 1
    assert [int(x) for x, _ in loop.batches()] == [2, 3]
    loss, flag = loop.share(torch.tensor(2.5))
    assert float(loss) == 2.5 and not loop.should_stop(bool(flag.item()))
    assert loop.exit_code == 0


def test_a_skip_streak_stops_the_run_with_exit_code_1(caplog):
    loop, job = _policy("--training.max_consecutive_skips", "2")
    skip = StepReport(committed=False, nonfinite=True, skipped="inf in gradients")
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            loop.batches()
            assert not loop.retry(skip)
            loop.count(skip)
            stopping = loop.should_stop(False)
    assert stopping and loop.exit_code == 1
    assert job.train_state.skipped_steps == 2 and job.lr_schedulers.steps == 0
    assert "step 1 skipped: inf in gradients; weights, optimizer state and lr" in caplog.text
    assert "steps 1-2 were all skipped for non-finite numbers" in caplog.text


def test_a_signal_before_step_1_trains_nothing_and_one_later_stops_after_the_step(caplog):
    loop, _ = _policy(signal_name="SIGTERM")
    with caplog.at_level(logging.WARNING):
        loop.agree_to_start()
    assert not loop.running()
    assert "stopped by SIGTERM before step 1: nothing trained" in caplog.text

    loop, job = _policy()
    job.train_state.step = 4
    with caplog.at_level(logging.WARNING):
        assert loop.should_stop(True)
    said = "a signal to another rank at step 4 of 10 (checkpoint.enable = false: nothing saved)"
    assert f"stopped by {said}; the same command resumes" in caplog.text
    assert loop.exit_code == 0


def test_a_lost_gate_saves_the_committed_step_and_exits_1(caplog):
    loop, job = _policy("--checkpoint.enable")
    job.train_state.step = 3
    with caplog.at_level(logging.ERROR):
        loop.gate_lost(GateLost("the lighthouse is gone"))
    assert job.checkpoint.saves == [(3, True)] and loop.exit_code == 1
    assert (
        "stopped at step 3 of 10: the lighthouse is gone; saved in /run/checkpoint" in caplog.text
    )


def test_a_stop_or_a_timeout_while_retrying_saves_the_data_position_of_the_steps_start(caplog):
    """The checkpoint of the last committed step holds the data where the uncommitted step
    began, so the resumed run reads that step's batches again."""
    for args, requested in (([], True), (["--fault_tolerance.uncommitted_timeout_ms", "1"], False)):
        loop, job = _policy(*args, "--checkpoint.enable")
        job.train_state.step = 3
        job.dataloader.index = 6  # the committed steps' batches
        list(loop.batches())
        assert job.dataloader.index == 8
        loop.stop.requested = requested
        loop.stop.signal = signal.SIGTERM if requested else None
        assert loop.retry(StepReport(committed=False, skipped="quorum failed"))
        saved_at: list = []

        def save(step: int, force: bool = False, saved_at=saved_at, data=job.dataloader) -> None:
            saved_at.append((step, data.state_dict()))

        job.checkpoint.maybe_save = save
        while not loop.stopped_retrying():
            pass  # (the timeout: 1 ms)
        assert saved_at == [(3, {"index": 6})]
        assert loop.exit_code == (0 if requested else 1)
