"""Train a model with an OptimizersContainer, with DCP checkpoints that resume and reshard.

    torchrun --standalone --nproc_per_node 2 train.py --job.config_file config/debug.toml
    python train.py --job.config_file config/debug.toml --training.steps 20   # one process

gloo on CPU, nccl on CUDA. Any key can be overridden as `--section.key value`.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import components  # noqa: F401  (registers the built-in train specs)
from components.checkpoint import CheckpointManager, ModelWrapper, TrainState
from components.ft import allreduce_gradients, build_ft_manager, serve_state
from components.grad_norm import clip_grad_norm_
from components.metrics import MetricsLogger, param_checksum
from components.train_spec import get_train_spec
from config import ConfigError, JobConfig, load_job_config

logger = logging.getLogger("train")


def accumulation_steps(cfg: JobConfig, dp_world_size: int) -> int:
    """Micro-batches per optimizer step on each rank, of `dp_world_size` data-parallel ranks
    (all replica groups' ranks under torchft: the global batch spans them all)."""
    t = cfg.training
    if t.global_batch_size < 0:
        return t.gradient_accumulation_steps
    per_micro = t.local_batch_size * dp_world_size
    accum, rest = divmod(t.global_batch_size, per_micro)
    if rest or accum == 0:
        raise ConfigError(
            f"[training] global_batch_size = {t.global_batch_size}: not a multiple of "
            f"local_batch_size {t.local_batch_size} x {dp_world_size} data-parallel ranks; "
            "change either"
        )
    if t.gradient_accumulation_steps not in (1, accum):
        raise ConfigError(
            f"[training] gradient_accumulation_steps = {t.gradient_accumulation_steps}: "
            f"global_batch_size {t.global_batch_size} implies {accum}; set only one of them"
        )
    return accum


def main(argv: list[str]) -> None:
    # -- config and processes --------------------------------------------------------------
    cfg = load_job_config(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    mesh = None
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        mesh = init_device_mesh(device.type, (world_size,))
    logging.getLogger().setLevel(logging.INFO if rank == 0 else logging.WARNING)
    ft = cfg.fault_tolerance
    if ft.enable and "MASTER_ADDR" not in os.environ:
        # torchft's manager needs a TCPStore for the replica group; torchrun starts one.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
    ft_manager = build_ft_manager(ft, rank, world_size, device)
    # Each replica group reads its own share of the data and keeps its own files.
    dp_rank, dp_world_size = ft.replica_id * world_size + rank, ft.group_size * world_size
    dump_folder = (
        os.path.join(cfg.job.dump_folder, f"replica_{ft.replica_id}")
        if ft.enable
        else cfg.job.dump_folder
    )
    accum = accumulation_steps(cfg, dp_world_size)

    # -- build ------------------------------------------------------------------------------
    spec = get_train_spec(cfg.model.name)
    torch.manual_seed(cfg.training.seed)
    model = spec.build_model_fn(cfg.model).to(device)
    if cfg.optimizer.container == "mixed_precision":  # low-precision params, fp32 masters
        model.to(getattr(torch, cfg.mixed_precision.param_dtype))
    n_params = sum(p.numel() for p in model.parameters())
    model_parts = spec.parallelize_fn(model, cfg.model, mesh)
    optimizers = spec.build_optimizers_fn(
        model_parts,
        cfg.optimizer,
        job_config=cfg,
        gradient_accumulation_steps=accum,
        ft_manager=ft_manager,
    )
    lr_schedulers = spec.build_lr_schedulers_fn(optimizers, cfg.lr_scheduler, cfg.training.steps)
    dataloader = spec.build_dataloader_fn(cfg.training, dp_rank, dp_world_size)
    loss_fn = spec.build_loss_fn(cfg.training)
    train_state = TrainState()
    states = {
        "model": ModelWrapper(model_parts),
        "optimizer": optimizers,
        "lr_scheduler": lr_schedulers,
        "dataloader": dataloader,
        "train_state": train_state,
    }
    if ft_manager is not None:
        serve_state(ft_manager, dict(states))  # what a healing peer receives
        states["ft_manager"] = ft_manager
    checkpoint = CheckpointManager(cfg.checkpoint, dump_folder, states, cfg.training.steps)
    checkpoint.load()
    metrics = MetricsLogger(
        cfg.metrics, dump_folder, total_steps=cfg.training.steps, enabled=rank == 0, device=device
    )
    params = [p for part in model_parts for p in part.parameters()]
    tokens_per_step = cfg.training.local_batch_size * cfg.training.seq_len * accum * world_size
    logger.info(
        "%s %s: %.2fM params in %d parts on %d %s ranks, %r, %d micro-batches/step, from step %d",
        cfg.model.name,
        cfg.model.flavor,
        n_params / 1e6,
        len(model_parts),
        world_size,
        device.type,
        optimizers,
        accum,
        train_state.step,
    )

    if train_state.step >= cfg.training.steps:
        logger.info(
            "already at step %d of %d: nothing to train (raise --training.steps or remove %s)",
            train_state.step,
            cfg.training.steps,
            checkpoint.folder,
        )

    # -- train ------------------------------------------------------------------------------
    while train_state.step < cfg.training.steps:
        start = time.perf_counter()
        optimizers.zero_grad()
        loss_sum = torch.zeros((), device=device)
        for _ in range(accum):
            inputs, labels = next(dataloader)
            h = inputs.to(device)
            for part in model_parts:
                h = part(h)
            loss = loss_fn(h, labels.to(device)) / accum
            optimizers.scale_loss(loss).backward()
            loss_sum += loss.detach()
        if ft_manager is not None:
            allreduce_gradients(ft_manager, params)
        # In-backward containers have stepped and freed the gradients by now; others clip
        # inside step() (mixed precision: on the unscaled gradients).
        grad_norm = None
        if not (optimizers.steps_in_backward or optimizers.clips_gradients):
            grad_norm = clip_grad_norm_(params, cfg.training.max_norm).item()
        optimizers.step()
        if not optimizers.last_step_committed:
            logger.warning("step %d was not committed; running it again", train_state.step + 1)
            continue
        train_state.step += 1
        lr = lr_schedulers.get_last_lr()  # read after step(): healing may have replaced it
        lr_schedulers.step()
        if world_size > 1:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        extra = {} if grad_norm is None else {"grad_norm": grad_norm}
        if optimizers.clips_gradients:
            extra |= {
                "grad_norm": optimizers.last_grad_norm,
                "loss_scale": optimizers.loss_scale,
                "skipped_steps": optimizers.scaler.skipped_steps,
            }
        if cfg.metrics.log_param_checksum:
            extra["param_checksum"] = param_checksum(params)
        metrics.log(
            train_state.step,
            loss_sum.item(),
            time.perf_counter() - start,
            tokens_per_step,
            lr=lr,
            **extra,
        )
        checkpoint.maybe_save(train_state.step)

    # -- close ------------------------------------------------------------------------------
    checkpoint.close()
    if cfg.checkpoint.export_model:
        checkpoint.export_model(model_parts, train_state.step)
    metrics.close()
    if ft_manager is not None:
        ft_manager.shutdown(wait=False)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        main(sys.argv[1:])
    except ConfigError as e:
        logger.error("error: %s", e)
        sys.exit(2)
