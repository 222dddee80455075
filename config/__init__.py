"""Typed job config: dataclass sections, TOML + CLI loading, and `ConfigError`."""

from config.checks import accumulation_steps, steps_in_backward
from config.errors import ConfigError
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
from config.loader import load_job_config

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
    "accumulation_steps",
    "load_job_config",
    "steps_in_backward",
]
