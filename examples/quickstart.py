"""Quick start: a model in 2 parts, FSDP2 over 2 gloo ranks, trained by one OptimizersContainer
built from a TOML config by the job builder, saved with DCP, then reloaded in a single process.

    .venv/bin/python examples/quickstart.py [--job.config_file config/quickstart.toml] [...]
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.checkpoint import ModelWrapper
from components.job import Job, build_job
from components.models.llama.data import ByteTextLoader
from config import JobConfig, load_job_config, usage

logger = logging.getLogger("quickstart")
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "config" / "quickstart.toml"


def loss_of(job: Job, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    h = inputs
    for part in job.model_parts:
        h = part(h)
    return job.loss_fn(h, labels)


def train_rank(rank: int, world_size: int, port: int, cfg: JobConfig, ckpt: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    job = build_job(cfg)  # FSDP2 parts over the 2 ranks, the container, LR schedule, data
    optimizers = job.optimizers
    logger.info(
        "container: %r over %d parts on %d ranks", optimizers, len(job.model_parts), world_size
    )
    for step in range(1, cfg.training.steps + 1):
        optimizers.zero_grad()
        loss = loss_of(job, *next(job.dataloader))
        optimizers.backward(loss)
        optimizers.step()
        job.lr_schedulers.step()
        if step == 1 or step % 10 == 0:
            logger.info("step %3d  loss %.4f", step, loss.item())
    dcp.save({"model": ModelWrapper(job.model_parts), "optim": optimizers}, checkpoint_id=ckpt)
    eval_batch = next(
        ByteTextLoader(
            cfg.training.seq_len, cfg.training.local_batch_size, 0, 1, cfg.training.seed + 1
        )
    )
    with torch.no_grad():  # every rank runs it: FSDP2 gathers parameters collectively
        eval_loss = loss_of(job, *eval_batch)
    if rank == 0:
        torch.save(eval_loss, Path(ckpt) / "eval_loss.pt")
    job.close()


def reload_single(cfg: JobConfig, ckpt: str) -> None:
    """Load the 2-rank checkpoint into plain (unsharded) parts in this one process."""
    os.environ.update(RANK="0", WORLD_SIZE="1")
    cfg.training.seed += 1  # different init, so a match proves the load
    job = build_job(cfg)
    with warnings.catch_warnings():  # DCP warns that it loads without a process group
        warnings.simplefilter("ignore", UserWarning)
        states = {"model": ModelWrapper(job.model_parts), "optim": job.optimizers}
        dcp.load(states, checkpoint_id=ckpt, no_dist=True)
    eval_batch = next(
        ByteTextLoader(cfg.training.seq_len, cfg.training.local_batch_size, 0, 1, cfg.training.seed)
    )
    with torch.no_grad():
        reloaded = loss_of(job, *eval_batch).item()
    trained = torch.load(Path(ckpt) / "eval_loss.pt").item()
    steps = {int(v) for k, v in job.optimizers.state_dict().items() if k.endswith(".step")}
    logger.info(
        "reloaded on 1 rank: optimizer step %s, eval loss %.4f (2-rank model: %.4f)",
        sorted(steps),
        reloaded,
        trained,
    )


def main(argv: list[str]) -> None:
    if {"-h", "--help"} & set(argv):
        print(f"{__doc__.strip()}\n\nIts config keys are train.py's (default file here: ", end="")
        print("config/quickstart.toml):\n")
        print(usage(), end="")
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not any(a.startswith("--job.config_file") for a in argv):
        argv = ["--job.config_file", str(DEFAULT_CONFIG), *argv]
    cfg = load_job_config(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as ckpt:
        mp.spawn(train_rank, args=(2, port, cfg, ckpt), nprocs=2, join=True)
        reload_single(cfg, ckpt)


if __name__ == "__main__":
    main(sys.argv[1:])
