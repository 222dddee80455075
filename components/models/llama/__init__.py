"""The built-in "llama" train spec: the reference decoder on byte-level stdlib text."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from components.models.llama.data import ByteTextLoader
from components.models.llama.model import FLAVORS, Transformer
from components.models.llama.parallelize import parallelize
from components.train_spec import LossFn, TrainSpec, register_train_spec
from config import ConfigError
from config import Model as ModelConfig
from config import Training as TrainingConfig

__all__ = ["build_dataloader", "build_loss", "build_model", "parallelize"]


def build_model(cfg: ModelConfig) -> Transformer:
    """The model of `[model] flavor`, initialized from torch's current RNG state."""
    if cfg.flavor not in FLAVORS:
        raise ConfigError(
            f"[model] flavor = {cfg.flavor!r}: unknown flavor; valid: {', '.join(FLAVORS)}"
        )
    return Transformer(FLAVORS[cfg.flavor])


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build_loss(cfg: TrainingConfig) -> LossFn:
    """Mean next-token cross-entropy over every position of the batch."""
    return _cross_entropy


def build_dataloader(cfg: TrainingConfig, dp_rank: int, dp_world_size: int) -> ByteTextLoader:
    """This rank's share of `[training] local_batch_size` x `seq_len` windows of stdlib bytes."""
    return ByteTextLoader(cfg.seq_len, cfg.local_batch_size, dp_rank, dp_world_size, cfg.seed)


register_train_spec(
    TrainSpec(
        name="llama",
        build_model_fn=build_model,
        parallelize_fn=parallelize,
        build_loss_fn=build_loss,
        build_dataloader_fn=build_dataloader,
    )
)
