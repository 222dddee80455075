"""Typed job config: dataclass sections, TOML + CLI loading, and `ConfigError`."""

from config.job_config import (
    Checkpoint,
    FaultTolerance,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    MixedPrecision,
    Model,
    Optimizer,
    ParamGroup,
    Training,
)
from config.loader import ConfigError, load_job_config

__all__ = [
    "Checkpoint",
    "ConfigError",
    "FaultTolerance",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "MixedPrecision",
    "Model",
    "Optimizer",
    "ParamGroup",
    "Training",
    "load_job_config",
]
