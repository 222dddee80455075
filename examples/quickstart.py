"""Quick start: a model in 2 parts, FSDP2 over 2 gloo ranks, trained by one OptimizersContainer
built from a TOML config, saved with DCP, then reloaded in a single process.

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
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.models.llama.data import ByteTextLoader
from components.models.llama.model import FLAVORS, Transformer, split_model
from components.optimizer import build_optimizers
from config import JobConfig, load_job_config

logger = logging.getLogger("quickstart")
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "config" / "quickstart.toml"


def build_parts(cfg: JobConfig) -> list[torch.nn.Module]:
    torch.manual_seed(cfg.training.seed)
    return split_model(Transformer(FLAVORS[cfg.model.flavor]), cfg.model.num_parts)


def loss_of(
    parts: list[torch.nn.Module], inputs: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    h = inputs
    for part in parts:
        h = part(h)
    return F.cross_entropy(h.flatten(0, 1), labels.flatten())


def train_rank(rank: int, world_size: int, port: int, cfg: JobConfig, ckpt: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    parts = build_parts(cfg)
    mesh = init_device_mesh("cpu", (world_size,))
    for part in parts:
        for block in part.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(part, mesh=mesh)
    optimizers = build_optimizers(parts, cfg.optimizer, job_config=cfg)
    logger.info("container: %r over %d parts on %d ranks", optimizers, len(parts), world_size)
    t = cfg.training
    data = ByteTextLoader(t.seq_len, t.local_batch_size, rank, world_size, t.seed)
    for step in range(1, t.steps + 1):
        optimizers.zero_grad()
        loss = loss_of(parts, *next(data))
        loss.backward()
        optimizers.step()
        if step == 1 or step % 10 == 0:
            logger.info("step %3d  loss %.4f", step, loss.item())
    model_sd = {k: v for part in parts for k, v in part.state_dict().items()}
    dcp.save({"model": model_sd, "optim": optimizers}, checkpoint_id=ckpt)
    eval_batch = next(ByteTextLoader(t.seq_len, t.local_batch_size, 0, 1, t.seed + 1))
    with torch.no_grad():  # every rank runs it: FSDP2 gathers parameters collectively
        eval_loss = loss_of(parts, *eval_batch)
    if rank == 0:
        torch.save(eval_loss, Path(ckpt) / "eval_loss.pt")
    dist.destroy_process_group()


def reload_single(cfg: JobConfig, ckpt: str) -> None:
    """Load the 2-rank checkpoint into plain (unsharded) parts in this one process."""
    cfg.training.seed += 1  # different init, so a match proves the load
    parts = build_parts(cfg)
    optimizers = build_optimizers(parts, cfg.optimizer, job_config=cfg)
    model_sd = {k: v for part in parts for k, v in part.state_dict().items()}
    with warnings.catch_warnings():  # DCP warns that it loads without a process group
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": model_sd, "optim": optimizers}, checkpoint_id=ckpt, no_dist=True)
    for part in parts:
        part.load_state_dict({k: v for k, v in model_sd.items() if k in part.state_dict()})
    t = cfg.training
    eval_batch = next(ByteTextLoader(t.seq_len, t.local_batch_size, 0, 1, t.seed))
    with torch.no_grad():
        reloaded = loss_of(parts, *eval_batch).item()
    trained = torch.load(Path(ckpt) / "eval_loss.pt").item()
    steps = {int(v) for k, v in optimizers.state_dict().items() if k.endswith(".step")}
    logger.info(
        "reloaded on 1 rank: optimizer step %s, eval loss %.4f (2-rank model: %.4f)",
        sorted(steps),
        reloaded,
        trained,
    )


def main(argv: list[str]) -> None:
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
