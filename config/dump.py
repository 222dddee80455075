"""`to_toml`: a resolved `JobConfig` as TOML that `--job.config_file` reads back to it."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from config.job_config import JobConfig

__all__ = ["to_toml"]


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # the loader refuses non-finite floats, so none get here
    # JSON strings are TOML basic strings, except that TOML also forbids a raw DEL.
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def _keys(table: Any) -> tuple[list[str], dict[str, list[Any]]]:
    """`key = value` lines of a section's scalars, and its arrays of tables by key."""
    lines, arrays = [], {}
    for f in dataclasses.fields(table):
        value = getattr(table, f.name)
        if isinstance(value, list):
            arrays[f.name] = value
        elif value is not None:
            # None is the default of every optional key (tests/config holds this), so a key
            # left out reads back as None.
            lines.append(f"{f.name} = {_value(value)}")
    return lines, arrays


def to_toml(cfg: JobConfig) -> str:
    """Every key of `cfg` as TOML: `load_job_config(["--job.config_file", path])` of the text
    gives `cfg` back (with `job.config_file` = that path)."""
    source = cfg.job.config_file
    lines = [
        "# The resolved config of this run: defaults, "
        + (f"{source}, " if source else "")
        + "command-line overrides.",
        "# Run it again with: python train.py --job.config_file <this file>",
    ]
    for section in dataclasses.fields(cfg):
        table = getattr(cfg, section.name)
        if section.name == "job":
            table = dataclasses.replace(table, config_file=None)  # the file read is the one given
        scalars, arrays = _keys(table)
        lines += ["", f"[{section.name}]", *scalars]
        for key, items in arrays.items():
            for item in items:
                lines += ["", f"[[{section.name}.{key}]]", *_keys(item)[0]]
    return "\n".join(lines) + "\n"
