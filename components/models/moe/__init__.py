"""The built-in "moe" train spec: llama's decoder with mixture-of-experts feed-forwards (token
choice top-k routing, grouped experts, a shared expert, aux-loss-free load balancing), on
llama's stdlib text, loss and data; experts split over `[parallelism] expert_parallel_degree`
ranks."""

from __future__ import annotations

from components.models.llama import build_dataloader, build_loss, check_fits, flavor_args
from components.models.moe.model import FLAVORS, Transformer, load_balance_buffers
from components.models.moe.parallelize import parallelize
from components.train_spec import TrainSpec, register_train_spec
from config import ConfigError, JobConfig
from config import Model as ModelConfig

__all__ = ["build_model", "load_balance_buffers", "parallelize", "validate_config"]


def validate_config(cfg: JobConfig) -> None:
    """Refuse, in one line, what the moe family cannot run (before any process starts)."""
    args = check_fits(cfg, "moe", FLAVORS)
    tp = cfg.parallelism.tensor_parallel_degree
    if tp > 1:
        raise ConfigError(
            f"[parallelism] tensor_parallel_degree = {tp}: the moe family has no tensor-"
            "parallel plan (its experts are split by expert_parallel_degree instead); set "
            "tensor_parallel_degree = 1"
        )
    ep = cfg.parallelism.expert_parallel_degree
    if args.num_experts % ep:
        raise ConfigError(
            f"[parallelism] expert_parallel_degree = {ep}: does not divide the "
            f"{args.num_experts} experts of moe flavor {cfg.model.flavor!r}, which each ep "
            f"rank holds an equal share of; use a divisor of {args.num_experts}"
        )


def build_model(cfg: ModelConfig) -> Transformer:
    """The model of `[model] flavor`, initialized from torch's current RNG state."""
    return Transformer(flavor_args(cfg, "moe", FLAVORS))


register_train_spec(
    TrainSpec(
        name="moe",
        build_model_fn=build_model,
        parallelize_fn=parallelize,
        build_loss_fn=build_loss,
        build_dataloader_fn=build_dataloader,
        balanced_layers_fn=load_balance_buffers,
        validate_config_fn=validate_config,
    )
)
