"""`build_job`: every piece of a training run, built from the job config in one place.

train.py, the tests, the examples and the benchmarks build their jobs here, so the state a
checkpoint holds and the way a container is composed exist once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from components.checkpoint import CheckpointManager, ModelWrapper, TrainState
from components.checkpoint.files import checkpoint_steps
from components.checkpoint.seed import open_seed
from components.comm import enable_flight_recorder, init_timeout, train_timeout_after_first_step
from components.ema_builder import build_ema
from components.ft import (
    Heals,
    build_ft_manager,
    build_gate,
    build_load_balance,
    build_outer,
    check_ft_config,
    check_outer,
    serve_state,
)
from components.lr_scheduler import LRSchedulersContainer
from components.optimizer import build_precision, cast_model, check_names
from components.parallel_dims import ParallelDims
from components.parallelize import mixed_precision_policy
from components.pipeline import Evaluate, ForwardBackward, backward_passes, build_passes
from components.run_lock import RunLocks, lock_dump_folder
from components.train_spec import Dataloader, LossFn, get_train_spec
from config import Comm as CommConfig
from config import JobConfig, accumulation_steps
from containers import DiLoCo, OptimizersContainer

if TYPE_CHECKING:
    from torchft import Manager

__all__ = ["Job", "build_job", "init_distributed", "run_folder", "validate_job"]


@dataclass(kw_only=True)
class Job:
    """A built training job: what the loop drives and what a checkpoint holds."""

    cfg: JobConfig
    device: torch.device
    rank: int
    world_size: int
    dims: ParallelDims
    mesh: DeviceMesh | None
    """The named mesh (`components.parallel_dims.MESH_DIMS`); None in one process."""
    model_parts: list[nn.Module]
    """This rank's parts: all of them, or its pipeline stages."""
    forward_backward: ForwardBackward
    evaluate_fn: Evaluate
    optimizers: OptimizersContainer
    lr_schedulers: LRSchedulersContainer
    dataloader: Dataloader
    loss_fn: LossFn
    train_state: TrainState
    checkpoint: CheckpointManager
    dump_folder: str
    accumulation_steps: int
    n_params: int
    ft_manager: Manager | None = None
    heals: Heals | None = None
    """How often this torchft replica group healed from a live peer (None without torchft)."""
    store: dist.TCPStore | None = None
    """The replica group's store when this process started it (torchft serves peers from it)."""
    run_lock: RunLocks | None = None
    """This run's hold on its dump and checkpoint folders (rank 0; None on the other ranks)."""
    eval_batch: tuple[torch.Tensor, torch.Tensor] | None = None
    """The held-out micro-batch of `evaluate` (`[ema] eval_every`): the first of another
    seed's window order, the same at every evaluation."""

    @property
    def tokens_per_step(self) -> int:
        t = self.cfg.training
        return t.local_batch_size * t.seq_len * self.accumulation_steps * self.dims.dp

    @property
    def loss_ranks(self) -> int:
        """Ranks whose `forward_backward` returns a loss (those of the last pipeline stage):
        the sum of every rank's loss over this is the mean loss."""
        return self.world_size // self.dims.pp

    def parameters(self) -> list[torch.Tensor]:
        return [p for part in self.model_parts for p in part.parameters()]

    def evaluate(self) -> dict[str, float]:
        """The held-out loss of the trained weights (`eval_loss`) and of their EMA
        (`ema_eval_loss`), the mean over the ranks that hold it."""
        if self.eval_batch is None:
            raise ValueError("this job has no eval batch: set [ema] eval_every")
        inputs, labels = (t.to(self.device) for t in self.eval_batch)
        trained = self.evaluate_fn(inputs, labels)
        with self.optimizers.ema_weights():
            averaged = self.evaluate_fn(inputs, labels)
        both = torch.stack([trained, averaged]).float()
        if self.world_size > 1:
            dist.all_reduce(both)
            both /= self.loss_ranks
        eval_loss, ema_eval_loss = both.tolist()
        return {"eval_loss": eval_loss, "ema_eval_loss": ema_eval_loss}

    def export_weights(self) -> contextlib.AbstractContextManager[None]:
        """What `[checkpoint] export_model` writes from: the averaged weights swapped in
        (`[ema] export`), or the trained ones as they are."""
        return self.optimizers.ema_weights() if self.cfg.ema.export else contextlib.nullcontext()

    def close(self) -> None:
        """Finish checkpoints in flight, end torchft and the process group, free the folder."""
        self.checkpoint.close()
        if self.ft_manager is not None:
            self.ft_manager.shutdown(wait=False)
        if dist.is_initialized():
            dist.destroy_process_group()
        self.release_folder()

    def release_folder(self) -> None:
        """Let another run use the dump folder (also done by the kernel when this one dies)."""
        if self.run_lock is not None:
            self.run_lock.release()


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(
    comm: CommConfig, dims: ParallelDims
) -> tuple[torch.device, DeviceMesh | None, int]:
    """This process's device, the job's named mesh (None alone) and rank.

    Starts the process group under torchrun (nccl on CUDA, gloo on CPU) unless it exists,
    with `[comm] init_timeout_seconds` for every wait until the first step is done.
    """
    rank = int(os.environ.get("RANK", "0"))
    device = _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dims.world_size == 1:
        return device, None, rank
    if not dist.is_initialized():
        enable_flight_recorder(comm)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=init_timeout(comm))
    return device, dims.build_mesh(device.type), rank


def validate_job(cfg: JobConfig, world_size: int | None = None) -> ParallelDims:
    """Raise `ConfigError` for anything in `cfg` this job cannot run, before any process group
    or connection exists: registry names (DiLoCo's outer optimizer too), the world size
    (default: the launcher's `WORLD_SIZE`), torchft's address and the model family's own rules
    (`TrainSpec.validate_config_fn`). Returns the resolved parallel degrees."""
    spec = get_train_spec(cfg.model.name)
    check_names(cfg.optimizer)
    ft = cfg.fault_tolerance
    check_ft_config(ft, _device())
    check_outer(cfg, spec.build_model_fn)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dims = ParallelDims.from_config(cfg, world_size)
    accumulation_steps(cfg.training, ft.group_size * dims.dp)
    if spec.validate_config_fn is not None:
        spec.validate_config_fn(cfg)
    ckpt = cfg.checkpoint
    seeds = ckpt.enable and ckpt.initial_load_path
    # Only a seed that would be used: a restart resumes its own checkpoint whatever the path.
    if seeds and not checkpoint_steps(Path(run_folder(cfg)) / ckpt.folder):
        open_seed(ckpt.initial_load_path, ckpt.initial_load_model_only)
    return dims


def model_settings(cfg: JobConfig, model: nn.Module) -> dict[str, Any]:
    """What a checkpoint records of its model: the family, the flavor and, where the model
    keeps them as a dataclass (`model.args`, as llama's and moe's do), its arguments."""
    args = getattr(model, "args", None)
    found = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else {}
    return {"model.name": cfg.model.name, "model.flavor": cfg.model.flavor, **found}


def run_folder(cfg: JobConfig) -> str:
    """This process's dump folder: each torchft replica group keeps its own files."""
    ft = cfg.fault_tolerance
    if ft.enable:
        return os.path.join(cfg.job.dump_folder, f"replica_{ft.replica_id}")
    return cfg.job.dump_folder


def build_job(cfg: JobConfig) -> Job:
    """Build model parts, container, LR schedules, data and checkpointed state for `cfg`.

    Nothing is loaded yet: `job.checkpoint.load()` resumes. `cfg` is validated first
    (`validate_job`), so a config this job cannot run costs no start-up; then the dump folder
    and checkpoint folders are locked (one live run per folder), before torchft connects or
    anything is written.
    """
    dims = validate_job(cfg)
    device, mesh, rank = init_distributed(cfg.comm, dims)
    dump_folder = run_folder(cfg)
    ckpt = cfg.checkpoint
    run_lock = lock_dump_folder(
        dump_folder, Path(dump_folder) / ckpt.folder if ckpt.enable else None
    )
    try:
        return _build_locked(cfg, device, dims, mesh, rank, dump_folder, run_lock)
    except BaseException:
        # A refused config must not keep the folder locked for the rest of this process.
        if run_lock is not None:
            run_lock.release()
        raise


def _build_locked(
    cfg: JobConfig,
    device: torch.device,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    rank: int,
    dump_folder: str,
    run_lock: RunLocks | None,
) -> Job:
    """`build_job` once the dump folder is this run's."""
    ft = cfg.fault_tolerance
    store = None
    if ft.enable and "MASTER_ADDR" not in os.environ:
        # torchft's manager needs a TCPStore for the replica group; torchrun starts one.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
    world_size = dims.world_size
    ft_manager = build_ft_manager(ft, rank, world_size, device)
    # Ranks of one pipeline and tensor-parallel group read the same batch.
    dp_rank, dp_world_size = ft.replica_id * dims.dp + dims.dp_rank(rank), ft.group_size * dims.dp
    accum = accumulation_steps(cfg.training, dp_world_size)

    spec = get_train_spec(cfg.model.name)
    torch.manual_seed(cfg.training.seed)
    precision = build_precision(cfg.optimizer, cfg.mixed_precision)
    model = cast_model(precision, spec.build_model_fn(cfg.model).to(device))
    n_params = sum(p.numel() for p in model.parameters())
    stages = dims.stages(rank, cfg.model.num_parts)
    policy = mixed_precision_policy(cfg.training)
    # Passed only when set, so a family that shards without mixed precision needs no argument.
    extra = {"mp_policy": policy} if policy is not None else {}
    model_parts = spec.parallelize_fn(
        model, cfg.model, mesh, stages, shard_impl=cfg.parallelism.data_parallel_shard_impl,
        **extra,
    )  # fmt: skip
    outer = [part for part in (build_outer(cfg, ft_manager),) if part is not None]
    if spec.balanced_layers_fn is not None:
        layers = spec.balanced_layers_fn(model_parts)
        diloco = next((part for part in outer if isinstance(part, DiLoCo)), None)
        outer.append(build_load_balance(cfg, layers, mesh, ft_manager, diloco))
    optimizers = spec.build_optimizers_fn(
        model_parts,
        cfg.optimizer,
        precision=precision,
        gate=build_gate(cfg, ft_manager),
        outer=outer,
        max_norm=cfg.training.max_norm,
        mesh=mesh,
        gradient_accumulation_steps=backward_passes(
            dims, cfg.parallelism, cfg.training.local_batch_size, accum
        ),
        ema=build_ema(cfg.ema),
    )
    if world_size > 1:
        train_timeout_after_first_step(optimizers, cfg.comm)
    loss_fn = spec.build_loss_fn(cfg.training)
    forward_backward, evaluate_fn = build_passes(
        parts=model_parts,
        stages=stages,
        num_parts=cfg.model.num_parts,
        loss_fn=loss_fn,
        optimizers=optimizers,
        accumulation_steps=accum,
        cfg=cfg.parallelism,
        local_batch_size=cfg.training.local_batch_size,
        mesh=mesh,
        device=device,
    )
    lr_schedulers = spec.build_lr_schedulers_fn(optimizers, cfg.lr_scheduler, cfg.training.steps)
    dataloader = spec.build_dataloader_fn(cfg.training, dp_rank, dp_world_size)
    eval_batch = None
    if cfg.ema.eval_every:
        held_out = dataclasses.replace(cfg.training, seed=cfg.training.seed + 1)
        eval_batch = next(iter(spec.build_dataloader_fn(held_out, dp_rank, dp_world_size)))
    train_state = TrainState()
    states: dict[str, Any] = {
        "model": ModelWrapper(model_parts),
        "optimizer": optimizers,
        "lr_scheduler": lr_schedulers,
        "dataloader": dataloader,
        "train_state": train_state,
    }
    heals = None
    if ft_manager is not None:
        heals = serve_state(ft_manager, dict(states))  # what a healing peer receives
        states["ft_manager"] = ft_manager
    checkpoint = CheckpointManager(
        cfg.checkpoint, dump_folder, states, cfg.training.steps, model_settings(cfg, model)
    )
    return Job(
        cfg=cfg,
        device=device,
        rank=rank,
        world_size=world_size,
        dims=dims,
        mesh=mesh,
        model_parts=model_parts,
        forward_backward=forward_backward,
        evaluate_fn=evaluate_fn,
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        dataloader=dataloader,
        loss_fn=loss_fn,
        train_state=train_state,
        checkpoint=checkpoint,
        dump_folder=dump_folder,
        accumulation_steps=accum,
        n_params=n_params,
        ft_manager=ft_manager,
        heals=heals,
        store=store,
        run_lock=run_lock,
        eval_batch=eval_batch,
    )
