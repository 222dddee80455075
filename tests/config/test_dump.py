"""`config.to_toml`: the resolved config as TOML that `--job.config_file` reads back."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

import config
from config import JobConfig, load_job_config, to_toml

ODD = [
    *("--job.dump_folder", 'quote " back \\ del \x7f tab \t é'),
    *("--lr_scheduler.decay_ratio", "0.25", "--optimizer.momentum", "0.5"),
    *("--optimizer.eps", "1e-30", "--training.max_norm", "0"),
]


def _sections() -> list[type]:
    return [*typing.get_type_hints(JobConfig).values(), config.ParamGroup]


@pytest.mark.parametrize(
    "argv",
    [[], ["--job.config_file", "config/muon.toml", *ODD]]
    + [["--job.config_file", str(p)] for p in sorted(Path("config").glob("*.toml"))],
)
def test_the_saved_config_loads_back_to_the_same_job(tmp_path, argv):
    cfg = load_job_config(argv)
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg), encoding="utf-8")
    again = load_job_config(["--job.config_file", str(path)])
    assert again == dataclasses.replace(
        cfg, job=dataclasses.replace(cfg.job, config_file=str(path))
    )


def test_a_key_left_out_for_none_reads_back_as_none():
    """The writer leaves None out (TOML has no null): right only while None is the default of
    every key that can be None."""
    for cls in _sections():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if type(None) in typing.get_args(hints[f.name]):
                assert f.default is None, f"{cls.__name__}.{f.name}"
