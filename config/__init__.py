"""Typed job config: dataclass sections, TOML + CLI loading, and `ConfigError`."""

from config.checks import accumulation_steps, fsdp_mixed_precision, steps_in_backward
from config.dump import to_toml
from config.errors import ConfigError
from config.job_config import (
    DILOCO_KEYS,
    EMA,
    Checkpoint,
    Comm,
    FaultTolerance,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    MixedPrecision,
    Model,
    Parallelism,
    ShardImpl,
    Training,
)
from config.loader import load_job_config
from config.optimizer_config import Optimizer, ParamGroup
from config.usage import field_docs, usage

__all__ = [
    "DILOCO_KEYS",
    "EMA",
    "Checkpoint",
    "Comm",
    "ConfigError",
    "FaultTolerance",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "MixedPrecision",
    "Model",
    "Optimizer",
    "Parallelism",
    "ParamGroup",
    "ShardImpl",
    "Training",
    "accumulation_steps",
    "field_docs",
    "fsdp_mixed_precision",
    "load_job_config",
    "steps_in_backward",
    "to_toml",
    "usage",
]
