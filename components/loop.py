"""What the training loop does with each step's outcome, so train.py's loop is only the step.

A step the gate did not commit (a torchft quorum that failed, nothing non-finite) runs again on
the same micro-batches. A skipped step (non-finite numbers) spends its batch; too many of them
in a row (`[training] max_consecutive_skips`) stop the run with exit code 1. A stop signal that
reached any rank stops every rank after the same step, agreed in the all-reduce that averages
the loss (or before step 1, in one of its own). A lost gate (`GateLost`) saves the last
committed state and stops with exit code 1. What every rank agrees on is said once, by rank 0.
A torchft replica group that heals from a live peer during a step takes the peer's step
number; the loss it computed before the heal is not that step's, and its row says so
(`row_loss`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from components.job import Job
from components.preemption import StopRequest
from config import JobConfig
from containers import GateLost, StepReport

__all__ = ["LoopPolicy"]

logger = logging.getLogger(__name__)

Batches = list[tuple[torch.Tensor, torch.Tensor]]


class LoopPolicy:
    """The retries, skips and stops of one run's training loop.

    Args:
        job: the built job (its train state, checkpoint manager, data and LR schedules).
        cfg: the run's config.
        stop: the stop request that the signal handlers set.
    """

    def __init__(self, job: Job, cfg: JobConfig, stop: StopRequest) -> None:
        self.job = job
        self.cfg = cfg
        self.stop = stop
        self.state = job.train_state
        self.steps = cfg.training.steps
        self.exit_code = 0
        """1 once the run stopped for a lost gate or a skip streak; 0 otherwise."""
        self._retry: Batches | None = None  # an uncommitted step's micro-batches, to run again
        self._uncommitted_since: float | None = None  # when this step's first attempt failed
        self._data_at_step_start: dict[str, Any] = {}  # the dataloader's, to drop a step
        self.interrupted = False
        """A stop signal came between this step's micro-batches (`stop_mid_step`)."""
        self._batches: Batches = []
        self._skipped_in_a_row: list[int] = []
        self._heals_before = 0  # the replica group's heals when this attempt's forward began
        self._stopped_early = False
        # What every rank agrees on is said once, by rank 0.
        quiet = (logger.debug, logger.debug)
        self._warn, self._fail = (logger.warning, logger.error) if job.rank == 0 else quiet

    def agree_to_start(self) -> None:
        """Stop before step 1, with nothing new to save, where a signal came while starting up
        (on any rank). A collective: every rank calls it once, before the loop."""
        early = torch.tensor(float(self.stop.requested), device=self.job.device)
        if self.job.world_size > 1:
            dist.all_reduce(early)
        self._stopped_early = early.item() > 0
        if self._stopped_early:
            self._warn(
                "stopped by %s before step %d: nothing trained, nothing new to save; the same "
                "command resumes",
                self._signal_name(),
                self.state.step + 1,
            )

    def running(self) -> bool:
        """Whether another step is to run (steps left, no stop before step 1)."""
        return self.state.step < self.steps and not self._stopped_early

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This step's micro-batches (inputs, labels): the uncommitted step's again, or the
        next ones, read one at a time. Between micro-batches the ranks agree on a stop signal
        (one scalar collective each, only where a step has several): on one, `interrupted`
        is set and no more come (the step is dropped: `stop_mid_step`)."""
        job = self.job
        self._heals_before = job.heals.count if job.heals is not None else 0
        retry, self._batches, self.interrupted = self._retry, [], False
        if retry is None:
            self._data_at_step_start = job.dataloader.state_dict()
        for i in range(job.accumulation_steps):
            if i and self._stop_agreed():
                self.interrupted = True
                return
            batch = retry[i] if retry is not None else next(job.dataloader)
            self._batches.append(batch)
            yield batch

    def _stop_agreed(self) -> bool:
        if self.job.world_size == 1:
            return self.stop.requested
        flag = torch.tensor(float(self.stop.requested), device=self.job.device)
        dist.all_reduce(flag)
        return flag.item() > 0

    def _save_committed(self) -> str:
        """Save the last committed step (the state has not changed since; the data goes back
        to the uncommitted step's start, so a resumed run runs it again); what was saved."""
        job, state = self.job, self.state
        if self._data_at_step_start:
            job.dataloader.load_state_dict(self._data_at_step_start)
        if not self.cfg.checkpoint.enable:
            return "checkpoint.enable = false: nothing saved"
        if state.step == 0:
            return "no step was committed: nothing to save"
        job.checkpoint.maybe_save(state.step, force=True)
        return f"step {state.step} saved in {job.checkpoint.folder}, the same command resumes"

    def stop_mid_step(self) -> None:
        """After a stop signal between micro-batches: drop the partial step (the data goes
        back to its start, so the resumed run runs it again), save the last committed step,
        say so in one line. The run exits 0."""
        job, state = self.job, self.state
        self._retry = None
        saved = self._save_committed()
        self._warn(
            "stopped by %s during step %d (after %d of its %d micro-batches, dropped); %s",
            self._signal_name(), state.step + 1, len(self._batches), job.accumulation_steps,
            saved,
        )  # fmt: skip

    def row_loss(
        self, loss: torch.Tensor, extra: dict[str, Any]
    ) -> tuple[float | None, str | None]:
        """The loss for this step's metrics row, and a note on the row where it has none.

        A torchft replica group that healed from a live peer during the step (inside
        `step()`: it now holds the peer's state and step number) ran the step's forward on
        its weights from before the heal, at an earlier step: that loss is not this step's,
        so the row has none. Under DiLoCo the heal comes after the inner step, whose gradient
        norm is dropped from `extra` too; under the every-step gate it comes before the
        gradients are averaged and measured, so the norm is this step's own.
        """
        heals = self.job.heals
        if heals is None or heals.count == self._heals_before:
            return loss.item(), None
        dropped = "loss"
        if self.cfg.fault_tolerance.semi_sync_method == "diloco" and "grad_norm" in extra:
            del extra["grad_norm"]
            dropped = "loss or grad_norm"
        return None, (
            f"healed from a peer replica group in this step: no {dropped}, its forward ran on "
            "the weights from before the heal"
        )

    def gate_lost(self, error: GateLost) -> None:
        """Save the last committed step (nothing changed since) and say why the run stops."""
        job, state = self.job, self.state
        if self._data_at_step_start:  # (the step's batches were read: read them again)
            job.dataloader.load_state_dict(self._data_at_step_start)
        job.checkpoint.maybe_save(state.step, force=True)
        self._fail(
            "stopped at step %d of %d: %s; %s",
            state.step,
            self.steps,
            error,
            f"saved in {job.checkpoint.folder}, the same command resumes"
            if self.cfg.checkpoint.enable
            else "checkpoint.enable = false: nothing saved",
        )
        self.exit_code = 1

    def retry(self, report: StepReport) -> bool:
        """Whether the step runs again on the same micro-batches: not committed, nothing
        non-finite (the gate's quorum failed). Between attempts a stop signal (agreed by the
        group's ranks) or `[fault_tolerance] uncommitted_timeout_ms` without a commit ends
        the run instead, the last committed step saved (`stopped`)."""
        if report.committed or report.nonfinite:
            self._retry = None
            self._uncommitted_since = None
            return False
        self._retry = self._batches
        now = time.monotonic()
        if self._uncommitted_since is None:
            self._uncommitted_since = now
        logger.warning(
            "step %d was not committed (%s); running it again on the same batch",
            self.state.step + 1,
            report.skipped,
        )
        return True

    def stopped_retrying(self) -> bool:
        """Whether to stop instead of retrying the uncommitted step: for a stop signal on any
        of the group's ranks (exit 0) or after `uncommitted_timeout_ms` of retries (exit 1);
        the last committed step (the state has not changed since) is saved and said. A
        collective: every rank of the group calls it after each uncommitted attempt."""
        limit = self.cfg.fault_tolerance.uncommitted_timeout_ms / 1000
        waited = time.monotonic() - (self._uncommitted_since or time.monotonic())
        job, state = self.job, self.state
        flags = torch.tensor([float(self.stop.requested), float(waited > limit)], device=job.device)
        if job.world_size > 1:
            dist.all_reduce(flags)
        stopping, timed_out = (bool(f) for f in flags.tolist())
        if not (stopping or timed_out):
            return False
        saved = self._save_committed()
        if stopping:
            self._warn(
                "stopped by %s while step %d was not committed; %s",
                self._signal_name(), state.step + 1, saved,
            )  # fmt: skip
            return True
        self._fail(
            "step %d was not committed for %.0f s ([fault_tolerance] uncommitted_timeout_ms = "
            "%d: too few replica groups reach its quorums, min_replica_size = %d); %s",
            state.step + 1, waited, self.cfg.fault_tolerance.uncommitted_timeout_ms,
            self.cfg.fault_tolerance.min_replica_size, saved,
        )  # fmt: skip
        self.exit_code = 1
        return True

    def count(self, report: StepReport) -> None:
        """Count the step: a committed one steps the LR schedules, a skipped one spends its
        batch and may add to the skip streak."""
        state = self.state
        state.step += 1
        if report.committed:
            self.job.lr_schedulers.step()
            self._skipped_in_a_row.clear()
            return
        state.skipped_steps += 1
        if not report.backing_off:  # a loss scale finding its level is not stuck
            self._skipped_in_a_row.append(state.step)
        self._warn(
            "step %d skipped: %s; %s, its batch spent",
            state.step,
            report.skipped,
            "the other units' weights and optimizer state stepped, the lr schedule did not"
            if report.partial
            else "weights, optimizer state and lr schedule unchanged",
        )

    def share(self, loss_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's loss (averaged over the ranks that hold it) and whether a stop signal
        reached any rank, in one collective: every rank calls it once a counted step."""
        job = self.job
        stop_flag = torch.tensor(float(self.stop.requested), device=job.device)
        shared = torch.stack([loss_sum, stop_flag])
        if job.world_size > 1:
            dist.all_reduce(shared)
            shared[0] /= job.loss_ranks  # the last pipeline stage's ranks hold the loss
        return shared[0], shared[1]

    def should_stop(self, stopping: bool) -> bool:
        """Whether the run stops after this step (saved by then): for the stop signal the
        ranks agreed on (`stopping`), or for a skip streak (exit code 1); says why."""
        job, cfg, state = self.job, self.cfg, self.state
        if stopping:
            self._warn(
                "stopped by %s at step %d of %d%s; the same command resumes",
                self._signal_name(),
                state.step,
                self.steps,
                f", saved in {job.checkpoint.folder}"
                if cfg.checkpoint.enable
                else " (checkpoint.enable = false: nothing saved)",
            )
            return True
        streak = self._skipped_in_a_row
        if len(streak) < cfg.training.max_consecutive_skips:
            return False
        checkpoint = job.checkpoint
        enabled = cfg.checkpoint.enable
        self._fail(
            "steps %d-%d were all skipped for non-finite numbers (gradients, or weights an "
            "update would overflow; [training] "
            "max_consecutive_skips = %d): stopping; nothing was saved during the skips; "
            "checkpoints kept in %s (%s): %s (lower [optimizer] lr and run again "
            "to resume the newest, or pick one with [checkpoint] load_step)",
            streak[0],
            streak[-1],
            cfg.training.max_consecutive_skips,
            checkpoint.folder,
            checkpoint.finite_kept() if enabled else "all finite",
            checkpoint.kept() if enabled else "none (not enabled)",
        )
        self.exit_code = 1
        return True

    def _signal_name(self) -> str:
        """The signal that stopped this rank, or that it came to another rank."""
        signal = self.stop.signal
        return signal.name if signal else "a signal to another rank"
