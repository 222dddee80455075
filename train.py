"""Train a model with an OptimizersContainer, with DCP checkpoints that resume and reshard.

    python train.py --nproc_per_node 2 --job.config_file config/debug.toml     # 2 ranks
    python train.py --job.config_file config/debug.toml --training.steps 20     # one process
    torchrun --standalone --nproc_per_node 2 train.py --job.config_file ...     # works too
    python train.py --help   # every section and key, with its default

gloo on CPU, nccl on CUDA. Any key can be overridden as `--section.key value`. A bad config is
one line and exit code 2; a collective that gets no answer within `[comm]
train_timeout_seconds` is one line naming it and exit code 1. The built-in launcher
(`components.launcher`) checks the config once before any rank starts and exits 0 when a
signal stopped the run after a save (torchrun exits 1 when signalled). SIGTERM, SIGINT or
SIGHUP: every rank finishes its step, saves and exits 0 (before step 1: exits 0, nothing to
save); a second signal exits at once. A save that runs out of disk: one line, exit 1.
"""

from __future__ import annotations

import components.startup_signals  # noqa: F401  (first: torch's imports take seconds)

# isort: split

import atexit
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from components.checkpoint_save import SaveFailed
from components.comm import collective_failure, speak_once
from components.job import build_job, validate_job
from components.launcher import launch, split_nproc
from components.logs import FORMAT, setup_logging, start_line
from components.metrics import MetricsLogger, group_lrs, lr_group_names, param_checksum
from components.preemption import StopRequest, watch_parent
from config import ConfigError, load_job_config, to_toml, usage
from containers import GateLost, SettingsMismatch

logger = logging.getLogger("train")


def main(argv: list[str]) -> int:
    """Train; return the exit code (0 done or stopped by a signal and saved, 1 diverged)."""
    # -- config and build -------------------------------------------------------------------
    if {"-h", "--help"} & set(argv):
        print(usage(), end="")
        return 0
    run_log = setup_logging(int(os.environ.get("RANK", "0")))  # other ranks: errors only
    watch_parent()
    stop = StopRequest()
    cfg = load_job_config(argv)
    resolved = to_toml(cfg)
    if cfg.job.print_config:
        logger.info("config (saved as config.toml in the dump folder):\n%s", resolved)
    job = build_job(cfg)
    run_log.keep_in(job.dump_folder)  # the folder is this run's now (and what was logged)
    # What every rank agrees on is said once, by rank 0.
    warn, fail = (logger.warning, logger.error) if job.rank == 0 else (logger.debug, logger.debug)
    job.checkpoint.load()
    if job.rank == 0:  # after the load: a refused resume leaves the folder's config as it was
        Path(job.dump_folder, "config.toml").write_text(resolved, encoding="utf-8")
    optimizers, state, steps = job.optimizers, job.train_state, cfg.training.steps
    metrics = MetricsLogger(
        cfg.metrics,
        job.dump_folder,
        total_steps=steps,
        enabled=job.rank == 0,
        device=job.device,
    )
    params = job.parameters()
    lr_names = lr_group_names(optimizers, cfg.optimizer)
    logger.info("%s", start_line(job, state.step))
    if state.step >= steps:
        logger.info(
            "already at step %d of %d: nothing to train (raise --training.steps or remove %s)",
            state.step,
            steps,
            job.checkpoint.folder,
        )

    # -- train ------------------------------------------------------------------------------
    retry = None  # the micro-batches of a step the gate did not commit: run again as they are
    skipped_in_a_row: list[int] = []
    exit_code = 0
    # A signal while starting up (any rank): stop before step 1, with nothing new to save.
    early = torch.tensor(float(stop.requested), device=job.device)
    if job.world_size > 1:
        dist.all_reduce(early)
    stopped_early = early.item() > 0
    if stopped_early:
        warn(
            "stopped by %s before step %d: nothing trained, nothing new to save; the same "
            "command resumes",
            stop.signal.name if stop.signal else "a signal to another rank",
            state.step + 1,
        )
    while state.step < steps and not stopped_early:
        start = time.perf_counter()
        batches = retry or [next(job.dataloader) for _ in range(job.accumulation_steps)]
        optimizers.zero_grad()
        loss_sum = torch.zeros((), device=job.device)
        for inputs, labels in batches:
            loss_sum += job.forward_backward(inputs.to(job.device), labels.to(job.device))
        try:
            optimizers.step()  # averages across replica groups, clips, decides, applies
        except SettingsMismatch as e:  # started with another group's config: exit 2, one line
            raise ConfigError(str(e)) from e
        except GateLost as e:  # nothing changed: the state is the last committed step's
            job.checkpoint.maybe_save(state.step, force=True)
            fail(
                "stopped at step %d of %d: %s; %s",
                state.step,
                steps,
                e,
                f"saved in {job.checkpoint.folder}, the same command resumes"
                if cfg.checkpoint.enable
                else "checkpoint.enable = false: nothing saved",
            )
            exit_code = 1
            break
        report = optimizers.last_report
        if not report.committed and not report.nonfinite:
            retry = batches
            logger.warning(
                "step %d was not committed (%s); running it again on the same batch",
                state.step + 1,
                report.skipped,
            )
            continue
        retry = None
        state.step += 1
        lrs = group_lrs(optimizers, lr_names)  # read after step(): healing may have set them
        if report.committed:
            job.lr_schedulers.step()
            skipped_in_a_row.clear()
        else:
            state.skipped_steps += 1
            if not report.backing_off:  # a loss scale finding its level is not stuck
                skipped_in_a_row.append(state.step)
            warn(
                "step %d skipped: %s; %s, its batch spent",
                state.step,
                report.skipped,
                "the other units' weights and optimizer state stepped, the lr schedule did not"
                if report.partial
                else "weights, optimizer state and lr schedule unchanged",
            )
        # One collective for the loss and for a stop signal that reached any rank.
        shared = torch.stack([loss_sum, torch.tensor(float(stop.requested), device=job.device)])
        if job.world_size > 1:
            dist.all_reduce(shared)
            shared[0] /= job.loss_ranks  # the last pipeline stage's ranks hold the loss
        extra = report.metrics()
        if cfg.metrics.log_param_checksum:
            extra["param_checksum"] = param_checksum(params)
        if cfg.ema.eval_every and state.step % cfg.ema.eval_every == 0:
            extra |= job.evaluate()
            logger.info(
                "step %5d  held-out loss %.4f, with the EMA weights %.4f",
                state.step, extra["eval_loss"], extra["ema_eval_loss"],
            )  # fmt: skip
        elapsed = time.perf_counter() - start
        metrics.log(
            state.step,
            shared[0].item(),
            elapsed,
            job.tokens_per_step,
            lrs=lrs,
            skipped_steps=state.skipped_steps,
            **extra,
        )
        stopping = shared[1].item() > 0
        # A skipped step changed nothing: no save over the good ones (`maybe_save`).
        job.checkpoint.maybe_save(state.step, force=stopping, skipped=not report.committed)
        if stopping:
            warn(
                "stopped by %s at step %d of %d%s; the same command resumes",
                stop.signal.name if stop.signal else "a signal to another rank",
                state.step,
                steps,
                f", saved in {job.checkpoint.folder}"
                if cfg.checkpoint.enable
                else " (checkpoint.enable = false: nothing saved)",
            )
            break
        if len(skipped_in_a_row) >= cfg.training.max_consecutive_skips:
            kept = job.checkpoint.kept() if cfg.checkpoint.enable else "none (not enabled)"
            fail(
                "steps %d-%d were all skipped for non-finite numbers (gradients, or weights an "
                "update would overflow; [training] "
                "max_consecutive_skips = %d): stopping; nothing was saved during the skips; "
                "checkpoints kept in %s (all finite): %s (lower [optimizer] lr and run again "
                "to resume the newest, or pick one with [checkpoint] load_step)",
                skipped_in_a_row[0],
                skipped_in_a_row[-1],
                cfg.training.max_consecutive_skips,
                job.checkpoint.folder,
                kept,
            )
            exit_code = 1
            break

    # -- close ------------------------------------------------------------------------------
    if cfg.checkpoint.export_model and state.step >= steps:
        with job.export_weights():  # the EMA's, where [ema] export
            job.checkpoint.export_model(job.model_parts, state.step)
    metrics.close()
    job.close()
    stop.close()
    run_log.close()
    return exit_code


def run(
    argv: list[str],
    script: str = __file__,
    entry: Callable[[list[str]], int] = main,
    train_args: Callable[[list[str]], list[str]] = list,
) -> int:
    """`entry(argv)` in this process, or `script` on `--nproc_per_node` ranks (with the
    config of `train_args(argv)` checked first); what fails in a way the user can fix ends
    in one line: a config error exits 2, a collective that got no answer exits 1."""
    try:
        nproc, args = split_nproc(argv)
        if nproc is None or {"-h", "--help"} & set(args):
            return entry(args)
        validate_job(load_job_config(train_args(args)), world_size=nproc)  # before any rank
        return launch(script, nproc, args)
    except ConfigError as e:
        speak_once(f"error: {e}", root_cause=True)  # under torchrun: rank 0's line only
        return 2
    except SaveFailed as e:
        speak_once(f"error: {e}", root_cause=True)
        return 1
    except Exception as e:
        failure = collective_failure(e)
        if failure is None:
            raise
        # A peer that exited first has its own line; one that stopped answering has none.
        speak_once(f"error: {failure.line}", root_cause=failure.timed_out)
        return 1  # the entry point exits with `exit_now`: no teardown of the broken group


def exit_now(code: int) -> NoReturn:
    """Exit with `code` (what `run` returned) once the lines are out, without the
    interpreter's teardown: after a run that stopped mid-job (its process group and checkpoint
    threads still live), and even after a closed one, torch's C++ objects destroyed at
    interpreter exit have aborted a rank now and then ("terminate called without an active
    exception", exit 134) after an exit-1 stop; everything the run writes is closed or flushed
    by then."""
    atexit._run_exitfuncs()  # what exit handlers do (release the run lock, end logging)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=FORMAT)
    exit_now(run(sys.argv[1:]))
