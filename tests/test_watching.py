"""A run you can watch: one 12-step 2-rank train.py run, then what its dump folder holds and
what `python -m scripts.plot` and `python -m scripts.inspect` make of it."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from config import load_job_config
from tests.harness.dist import run_script, train_ranks

ARGS = [
    *("--job.config_file", "config/debug.toml", "--model.flavor", "tiny"),
    *("--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "12"),
    *("--lr_scheduler.warmup_steps", "4", "--metrics.log_freq", "5"),
    *("--checkpoint.interval", "6", "--checkpoint.keep_latest_k", "0"),
    *("--metrics.enable_tensorboard", "--job.print_config"),
]
TOKENS_PER_STEP = 2 * 2 * 32  # ranks x local batch x seq_len


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    dump = tmp_path_factory.mktemp("watched") / "run"
    argv = [*ARGS, "--job.dump_folder", str(dump)]
    started = time.time()
    result = train_ranks(2, argv)
    assert result.returncode == 0, result.stdout[-6000:]
    return dump, argv, started, time.time()


def _tool(name: str, *args: str, cwd) -> str:
    """What `python -m scripts.<name>` prints, run from another directory as a process of its
    own (the scripts' smoke test); it must exit 0."""
    out = run_script(name, *args, cwd=cwd, process=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_the_dump_folder_holds_log_config_metrics_and_tensorboard_events(run):
    dump, argv, started, ended = run
    log = (dump / "train.log").read_text()
    assert log.count("micro-batches/step, from step 0") == 1  # rank 0's lines, once
    assert "[optimizer]" in log and "step    12" in log  # --job.print_config, the steps

    cfg, path = load_job_config(argv), str(dump / "config.toml")
    saved = load_job_config(["--job.config_file", path])
    assert saved == dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, config_file=path))

    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 5, 10, 12]
    assert all(started <= r["time"] <= ended for r in rows)
    assert [r["time"] for r in rows] == sorted(r["time"] for r in rows)
    for row in rows:  # window throughput: tokens per step over the window's mean step time
        assert row["tokens_per_s"] == pytest.approx(TOKENS_PER_STEP / row["step_time_s"])
        assert row["lr"] == row["lr/AdamW-default"] and "lr/AdamW-group0" in row

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(dump / "tb")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (r["step"], pytest.approx(r["loss"])) for r in rows
    ]
    assert {"grad_norm", "tokens_per_s", "lr/AdamW-default"} <= set(events.Tags()["scalars"])


@pytest.mark.slow
def test_plot_and_inspect_read_the_run(run, tmp_path):
    dump = run[0]
    printed = _tool("plot", str(dump), str(dump), cwd=tmp_path)
    assert printed.strip() == f"wrote {dump / 'loss.png'}: loss of 2 runs"
    assert (dump / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    listing = _tool("inspect", str(dump / "checkpoint" / "step-6"), cwd=tmp_path)
    assert listing.splitlines()[0].startswith(f"{dump / 'checkpoint' / 'step-6'}: step 6;")
    for line in (
        "optimizer state, by name:",
        "optimizer param groups, by key",
        "lr_scheduler: step = 6",
        "train_state: step = 6, skipped_steps = 0",
    ):
        assert line in listing, listing
    assert "  exp_avg_sq  " in listing and "  output.weight  " in listing, listing


def test_plot_labels_runs_by_the_config_keys_that_differ_between_them(tmp_path):
    from config import to_toml
    from scripts.plot import labels

    runs = {
        "fp32": [],
        "bf16": ["--optimizer.moment_dtype", "bfloat16"],
        "bf16_again": ["--optimizer.moment_dtype", "bfloat16"],
        "lr": ["--optimizer.lr", "0.001"],
    }
    for name, args in runs.items():
        folder = tmp_path / name
        folder.mkdir()
        dump = ["--job.dump_folder", str(folder)]  # differs, but says where, not what
        (folder / "config.toml").write_text(to_toml(load_job_config([*ARGS, *dump, *args])))
    (tmp_path / "none").mkdir()  # no config.toml: its folder
    folders = [tmp_path / name for name in [*runs, "none"]]
    default_lr = load_job_config([]).optimizer.lr
    assert labels(folders) == [
        f"optimizer.lr={default_lr}, optimizer.moment_dtype=float32",
        f"optimizer.lr={default_lr}, optimizer.moment_dtype=bfloat16 ({folders[1]})",
        f"optimizer.lr={default_lr}, optimizer.moment_dtype=bfloat16 ({folders[2]})",
        "optimizer.lr=0.001, optimizer.moment_dtype=float32",
        str(folders[4]),
    ]
