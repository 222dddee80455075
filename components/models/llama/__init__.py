"""The built-in "llama" train spec: the reference decoder on byte-level stdlib text."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from components.lr_scheduler import build_lr_schedulers
from components.models.llama.data import ByteTextLoader
from components.models.llama.model import FLAVORS, Transformer
from components.models.llama.parallelize import parallelize
from components.train_spec import TrainSpec, register_train_spec
from config import ConfigError, JobConfig

__all__ = ["build_model"]


def build_model(job_config: JobConfig) -> Transformer:
    """The model of `[model] flavor`, initialized from `[training] seed`."""
    flavor = job_config.model.flavor
    if flavor not in FLAVORS:
        raise ConfigError(
            f"[model] flavor = {flavor!r}: unknown flavor; valid: {', '.join(FLAVORS)}"
        )
    torch.manual_seed(job_config.training.seed)
    return Transformer(FLAVORS[flavor])


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


register_train_spec(
    TrainSpec(
        name="llama",
        build_model_fn=build_model,
        parallelize_fn=lambda model, job_config, mesh: parallelize(model, job_config.model, mesh),
        build_loss_fn=lambda job_config: _loss,
        build_dataloader_fn=lambda job_config, dp_rank, dp_world_size: ByteTextLoader(
            job_config.training.seq_len,
            job_config.training.local_batch_size,
            dp_rank,
            dp_world_size,
            job_config.training.seed,
        ),
        build_lr_schedulers_fn=lambda optimizers, job_config: build_lr_schedulers(
            optimizers, job_config.lr_scheduler, job_config.training.steps
        ),
    )
)
