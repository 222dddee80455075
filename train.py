"""Train a model with an OptimizersContainer, with DCP checkpoints that resume and reshard.

    torchrun --standalone --nproc_per_node 2 train.py --job.config_file config/debug.toml
    python train.py --job.config_file config/debug.toml --training.steps 20   # one process
    python train.py --help   # every section and key, with its default

gloo on CPU, nccl on CUDA. Any key can be overridden as `--section.key value`. A bad config is
one line and exit code 2; a collective that gets no answer within `[comm]
train_timeout_seconds` is one line naming it and exit code 1.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from components.comm import collective_failure, speak_once
from components.job import build_job
from components.metrics import MetricsLogger, param_checksum
from config import ConfigError, load_job_config, usage

logger = logging.getLogger("train")


def main(argv: list[str]) -> None:
    # -- config and build -------------------------------------------------------------------
    if {"-h", "--help"} & set(argv):
        print(usage(), end="")
        return
    cfg = load_job_config(argv)
    job = build_job(cfg)
    logging.getLogger().setLevel(logging.INFO if job.rank == 0 else logging.WARNING)
    job.checkpoint.load()
    optimizers, state, steps = job.optimizers, job.train_state, cfg.training.steps
    metrics = MetricsLogger(
        cfg.metrics, job.dump_folder, total_steps=steps, enabled=job.rank == 0, device=job.device
    )
    params = job.parameters()
    logger.info(
        "%s %s: %.2fM params in %d parts on %d %s ranks, %r, %d micro-batches/step, from step %d",
        cfg.model.name,
        cfg.model.flavor,
        job.n_params / 1e6,
        len(job.model_parts),
        job.world_size,
        job.device.type,
        optimizers,
        job.accumulation_steps,
        state.step,
    )
    if state.step >= steps:
        logger.info(
            "already at step %d of %d: nothing to train (raise --training.steps or remove %s)",
            state.step,
            steps,
            job.checkpoint.folder,
        )

    # -- train ------------------------------------------------------------------------------
    while state.step < steps:
        start = time.perf_counter()
        optimizers.zero_grad()
        loss_sum = torch.zeros((), device=job.device)
        for _ in range(job.accumulation_steps):
            inputs, labels = next(job.dataloader)
            h = inputs.to(job.device)
            for part in job.model_parts:
                h = part(h)
            loss = job.loss_fn(h, labels.to(job.device)) / job.accumulation_steps
            optimizers.backward(loss)
            loss_sum += loss.detach()
        optimizers.step()  # averages across replica groups, clips, decides, applies
        report = optimizers.last_report
        if not report.committed:
            logger.warning(
                "step %d was not applied (%s); running it again", state.step + 1, report.skipped
            )
            continue
        state.step += 1
        lr = job.lr_schedulers.get_last_lr()  # read after step(): healing may have replaced it
        job.lr_schedulers.step()
        if job.world_size > 1:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        extra = report.metrics()
        if cfg.metrics.log_param_checksum:
            extra["param_checksum"] = param_checksum(params)
        elapsed = time.perf_counter() - start
        metrics.log(state.step, loss_sum.item(), elapsed, job.tokens_per_step, lr=lr, **extra)
        job.checkpoint.maybe_save(state.step)

    # -- close ------------------------------------------------------------------------------
    if cfg.checkpoint.export_model:
        job.checkpoint.export_model(job.model_parts, state.step)
    metrics.close()
    job.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        main(sys.argv[1:])
    except ConfigError as e:
        speak_once(f"error: {e}", root_cause=True)  # under torchrun: rank 0's line only
        sys.exit(2)
    except Exception as e:
        failure = collective_failure(e)
        if failure is None:
            raise
        # A peer that exited first has its own line; one that stopped answering has none.
        speak_once(f"error: {failure.line}", root_cause=failure.timed_out)
        logging.shutdown()
        # The process group is broken: its teardown at interpreter exit can abort the process.
        os._exit(1)
