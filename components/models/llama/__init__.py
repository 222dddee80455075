"""The built-in "llama" train spec: the reference decoder on byte-level stdlib text."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from components.models.llama.data import ByteTextLoader, load_corpus
from components.models.llama.model import FLAVORS, ModelArgs, Transformer
from components.models.llama.parallelize import parallelize
from components.train_spec import LossFn, TrainSpec, register_train_spec
from config import ConfigError, JobConfig
from config import Model as ModelConfig
from config import Training as TrainingConfig

__all__ = [
    "DATASETS",
    "activation_bytes",
    "build_dataloader",
    "build_loss",
    "build_model",
    "check_fits",
    "flavor_args",
    "parallelize",
    "validate_config",
]

DATASETS: dict[str, Callable[[], torch.Tensor]] = {"stdlib": load_corpus}
"""`[training] dataset` -> the function that returns its bytes (uint8)."""


def flavor_args(
    cfg: ModelConfig, family: str = "llama", flavors: Mapping[str, ModelArgs] = FLAVORS
) -> ModelArgs:
    """The args of `[model] flavor` among a `family`'s `flavors`."""
    if cfg.flavor not in flavors:
        raise ConfigError(
            f"[model] flavor = {cfg.flavor!r}: unknown flavor; valid {family} flavors: "
            f"{', '.join(flavors)}"
        )
    return flavors[cfg.flavor]


def _dataset(cfg: TrainingConfig) -> Callable[[], torch.Tensor]:
    if cfg.dataset not in DATASETS:
        raise ConfigError(
            f"[training] dataset = {cfg.dataset!r}: not a llama dataset; valid: "
            f"{', '.join(DATASETS)}"
        )
    return DATASETS[cfg.dataset]


def check_fits(cfg: JobConfig, family: str, flavors: Mapping[str, ModelArgs]) -> ModelArgs:
    """The args of `[model] flavor` among `flavors` of a decoder `family` built on llama's:
    `ConfigError` for an unknown flavor, a `[training] seq_len` beyond its rotary table or
    more `[model] num_parts` than layers; and for a dataset the family cannot read."""
    args = flavor_args(cfg.model, family, flavors)
    seq_len = cfg.training.seq_len
    if seq_len > args.max_seq_len:
        # Beyond its rotary table the model would fail deep inside attention.
        sizes = ", ".join(f"{name}: {a.max_seq_len}" for name, a in flavors.items())
        raise ConfigError(
            f"[training] seq_len = {seq_len}: above the {args.max_seq_len} positions of "
            f"{family} flavor {cfg.model.flavor!r}; use seq_len <= {args.max_seq_len} or a "
            f"flavor with more ({sizes})"
        )
    if cfg.model.num_parts > args.n_layers:
        raise ConfigError(
            f"[model] num_parts = {cfg.model.num_parts}: {family} flavor "
            f"{cfg.model.flavor!r} has {args.n_layers} layers to split; use num_parts <= "
            f"{args.n_layers}"
        )
    _dataset(cfg.training)
    _check_memory(cfg, args)
    return args


def activation_bytes(cfg: TrainingConfig, args: ModelArgs) -> int:
    """A low estimate of the activations one micro-batch keeps for backward (fp32): per token
    and layer the block's inputs, attention and feed-forward values (8 x dim + 3 x ffn_hidden)
    and attention probabilities (n_heads x seq_len), and the logits twice."""
    per_layer = 8 * args.dim + 3 * args.ffn_hidden + args.n_heads * cfg.seq_len
    per_token = args.n_layers * per_layer + 2 * args.vocab_size
    return cfg.local_batch_size * cfg.seq_len * per_token * 4


def _check_memory(cfg: JobConfig, args: ModelArgs) -> None:
    """Refuse a micro-batch whose activations alone exceed this machine's available memory
    (it would only grow until the machine swaps or kills the run)."""
    need, free = activation_bytes(cfg.training, args), _available_bytes()
    if free is None or need <= free:
        return
    per_sequence = need // cfg.training.local_batch_size
    raise ConfigError(
        f"[training] local_batch_size = {cfg.training.local_batch_size}: its activations need "
        f"about {need / 2**30:.1f} GiB (seq_len {cfg.training.seq_len}, flavor "
        f"{cfg.model.flavor!r}), above the {free / 2**30:.1f} GiB this machine has available; "
        f"use local_batch_size <= {max(1, free // per_sequence)} (gradient_accumulation_steps "
        "keeps the global batch)"
    )


def _available_bytes() -> int | None:
    """The memory this machine can give (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _no_experts(cfg: JobConfig) -> None:
    """Refuse the keys only a mixture of experts reads (the llama blocks have none)."""
    ep = cfg.parallelism.expert_parallel_degree
    if ep != 1:
        raise ConfigError(
            f"[parallelism] expert_parallel_degree = {ep}: the llama family has no experts "
            "to split; set expert_parallel_degree = 1 or [model] name = 'moe'"
        )
    coeff, default = cfg.model.load_balance_coeff, ModelConfig().load_balance_coeff
    if coeff != default:
        raise ConfigError(
            f"[model] load_balance_coeff = {coeff!r}: the llama family has no experts to "
            f"balance; remove it (only its default {default!r} is accepted) or set [model] "
            "name = 'moe'"
        )


def validate_config(cfg: JobConfig) -> None:
    """Refuse, in one line, what the llama family cannot run (before any process starts)."""
    args = check_fits(cfg, "llama", FLAVORS)
    _no_experts(cfg)
    tp = cfg.parallelism.tensor_parallel_degree
    for key, count in (("n_heads", args.n_heads), ("ffn_hidden", args.ffn_hidden)):
        if count % tp:
            raise ConfigError(
                f"[parallelism] tensor_parallel_degree = {tp}: does not divide the {count} "
                f"{key} of llama flavor {cfg.model.flavor!r}, which tensor parallelism splits; "
                f"use a divisor of {count}"
            )


def build_model(cfg: ModelConfig) -> Transformer:
    """The model of `[model] flavor`, initialized from torch's current RNG state."""
    return Transformer(flavor_args(cfg))


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build_loss(cfg: TrainingConfig) -> LossFn:
    """Mean next-token cross-entropy over every position of the batch."""
    return _cross_entropy


def build_dataloader(cfg: TrainingConfig, dp_rank: int, dp_world_size: int) -> ByteTextLoader:
    """This rank's share of `[training] local_batch_size` x `seq_len` windows of the bytes of
    `[training] dataset`."""
    corpus = _dataset(cfg)()
    return ByteTextLoader(
        cfg.seq_len, cfg.local_batch_size, dp_rank, dp_world_size, cfg.seed, corpus=corpus
    )


register_train_spec(
    TrainSpec(
        name="llama",
        build_model_fn=build_model,
        parallelize_fn=parallelize,
        build_loss_fn=build_loss,
        build_dataloader_fn=build_dataloader,
        validate_config_fn=validate_config,
    )
)
