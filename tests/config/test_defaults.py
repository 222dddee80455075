"""The defaults are a job that runs, every key is documented in `--help`, and every key is read."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from config import JobConfig, MixedPrecision, ParamGroup, field_docs, load_job_config, usage
from tests.harness.dist import REPO

SECTIONS = typing.get_type_hints(JobConfig)
CLASSES = [*SECTIONS.values(), ParamGroup]


def test_no_file_an_empty_file_and_debug_toml_are_the_same_job(tmp_path):
    """Model, data, optimizer, schedule and steps of the defaults are config/debug.toml's."""
    empty = tmp_path / "empty.toml"
    empty.write_text("", encoding="utf-8")
    bare = load_job_config([])
    from_empty = load_job_config(["--job.config_file", str(empty)])
    assert dataclasses.replace(from_empty, job=bare.job) == bare
    debug = load_job_config(["--job.config_file", str(Path(REPO) / "config" / "debug.toml")])
    for section in ("model", "lr_scheduler", "training"):
        assert getattr(debug, section) == getattr(bare, section), section
    assert dataclasses.replace(debug.optimizer, param_groups=[]) == bare.optimizer
    assert bare.training.seq_len == 128 and bare.training.steps == 200


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_key_has_a_docstring_shown_by_help(cls):
    text = usage()
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring under it"
        assert f"\n  {f.name}: " in text, f.name
        assert docs[f.name].split()[0] in text, f.name
    assert "  seq_len: int = 128\n      Tokens per sequence" in text
    choices = '"auto" | "fused" | "foreach" | "for-loop" | "compiled"'
    assert f'  implementation: {choices} = "auto"' in text
    assert "\n[[optimizer.param_groups]]" in text and "\n[comm]\n" in text


def _attributes_read() -> set[str]:
    """Every `x.name` in the code that consumes the config (not the dataclasses themselves)."""
    files = [Path(REPO) / "train.py"]
    for pkg in ("components", "containers", "config"):
        files += (Path(REPO) / pkg).rglob("*.py")
    names = set()
    for path in files:
        if path.name in ("job_config.py", "usage.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
    return names


def test_every_key_is_read_somewhere():
    """No key is accepted and ignored (the loader itself reads `job.config_file`)."""
    read = _attributes_read() | {"config_file"}
    unread = [
        f"{section}.{f.name}"
        for section, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
        if f.name not in read
    ]
    assert not unread, f"config keys that nothing reads: {unread}"


def test_mixed_precision_is_the_librarys_settings_key_for_key():
    """`[mixed_precision]` has the library's keys and defaults, and its values reach the
    library's `MixedPrecisionSettings` as they are."""
    from containers import MixedPrecisionSettings

    assert dataclasses.asdict(MixedPrecision()) == dataclasses.asdict(MixedPrecisionSettings())
    section = MixedPrecision(
        param_dtype="float16",
        loss_scaling="static",
        initial_scale=8.0,
        growth_interval=3,
        store_param_remainders=False,
        grad_accumulation_dtype="float32",
    )
    assert dataclasses.asdict(section.settings()) == dataclasses.asdict(section)
