"""`ConfigError`: every problem with a job config, in one line."""

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """An invalid job config: the message names section, key, value and fix."""
