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
save); a second signal exits at once. A save that runs out of disk: one line, exit 1; a last
save refused for inf or NaN: its line, exit 1.
"""

from __future__ import annotations

import components.startup_signals  # noqa: F401  (first: torch's imports take seconds)

# isort: split

import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch

from components.agreement import SettingsMismatch
from components.checkpoint import SaveFailed
from components.comm import collective_failure, speak_once
from components.job import build_job, validate_job
from components.launcher import launch, split_nproc
from components.logs import FORMAT, setup_logging, start_line
from components.loop import LoopPolicy
from components.metrics import MetricsLogger, group_lrs, lr_group_names, param_checksum
from components.preemption import StopRequest, watch_parent
from components.run_lock import release_held
from config import ConfigError, load_job_config, to_toml, usage
from containers import GateLost

logger = logging.getLogger("train")


def main(argv: list[str]) -> int:
    """Train; return the exit code (0 done or stopped by a signal and saved, 1 diverged or the
    last save refused)."""
    # -- config and build -------------------------------------------------------------------
    if {"-h", "--help"} & set(argv):
        print(usage(), end="")
        return 0
    run_log = setup_logging(int(os.environ.get("RANK", "0")))  # other ranks: errors only
    watch_parent()
    stop = StopRequest()
    cfg = load_job_config(argv)
    if cfg.fault_tolerance.enable:  # replica groups run side by side: tell their lines apart
        run_log.tag_group(cfg.fault_tolerance.replica_id)
    resolved = to_toml(cfg)
    if cfg.job.print_config:
        logger.info("config (saved as config.toml in the dump folder):\n%s", resolved)
    job = build_job(cfg)
    stop.arm(cfg.training.stop_grace_seconds, job.checkpoint.newest)
    run_log.keep_in(job.dump_folder)  # the folder is this run's now (and what was logged)
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
    loop = LoopPolicy(job, cfg, stop)  # retries, skips and stops: components/loop.py
    loop.agree_to_start()  # a signal while starting up (any rank): no step 1
    while loop.running():
        start = time.perf_counter()
        optimizers.zero_grad()
        loss_sum = torch.zeros((), device=job.device)
        for inputs, labels in loop.batches():  # an uncommitted step's again, or the next ones
            loss_sum += job.forward_backward(inputs.to(job.device), labels.to(job.device))
        if loop.interrupted:  # a stop signal between micro-batches: the step is dropped
            loop.stop_mid_step()
            break
        try:
            optimizers.step()  # averages across replica groups, clips, decides, applies
        except SettingsMismatch as e:  # started with another group's config: exit 2, one line
            raise ConfigError(str(e)) from e
        except GateLost as e:  # nothing changed: the state is the last committed step's
            loop.gate_lost(e)  # saves, says why; exit code 1
            break
        report = optimizers.last_report
        if loop.retry(report):  # not committed, nothing non-finite: the same batches again
            if loop.stopped_retrying():  # a stop signal, or no commit for too long: saved
                break
            continue
        lrs = group_lrs(optimizers, lr_names)  # read after step(): healing may have set them
        loop.count(report)  # the step counted: committed (lr schedule steps) or skipped
        loss, stop_flag = loop.share(loss_sum)  # one collective: loss, a signal on any rank
        extra = report.metrics() | (optimizers.metrics() if report.committed else {})
        row_loss, note = loop.row_loss(loss, extra)  # none after a heal inside the step
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
            row_loss,
            elapsed,
            job.tokens_per_step,
            lrs=lrs,
            note=note,
            skipped_steps=state.skipped_steps,
            **extra,
        )
        stopping = stop_flag.item() > 0
        # A skipped step changed nothing: no save over the good ones (`maybe_save`).
        job.checkpoint.maybe_save(state.step, force=stopping, skipped=not report.committed)
        if loop.should_stop(stopping):  # the signal (saved above), or too many skips in a row
            break

    # -- close ------------------------------------------------------------------------------
    if cfg.checkpoint.export_model and state.step >= steps:
        with job.export_weights():  # the EMA's, where [ema] export
            job.checkpoint.export_model(job.model_parts, state.step)
    metrics.close()
    job.close()
    stop.close()
    run_log.close()
    # A last save refused for inf or NaN (said in its line) left no checkpoint of the end.
    return loop.exit_code or int(job.checkpoint.last_save_refused)


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
    release_held()  # what the run lock's atexit hook does: the folders free for the next run
    logging.shutdown()  # and logging's: train.log and the console flushed and closed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=FORMAT)
    exit_now(run(sys.argv[1:]))
