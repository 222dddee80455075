"""MetricsLogger's metrics.jsonl and param_checksum over sharded parameters."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from components.metrics import MetricsLogger, param_checksum
from components.parallelize import shard_parts
from config import Metrics
from tests.harness.dist import run_ranks
from tests.harness.helpers import three_parts

CPU = torch.device("cpu")


def _logger(folder: Path, total_steps: int = 10, enabled: bool = True, **cfg) -> MetricsLogger:
    return MetricsLogger(
        Metrics(**cfg), str(folder), total_steps=total_steps, enabled=enabled, device=CPU
    )


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _rows(folder: Path) -> list[dict]:
    """metrics.jsonl, parsed strictly: NaN and Infinity tokens fail the read."""
    lines = (folder / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line, parse_constant=_reject_constant) for line in lines]


def test_one_line_per_step_with_its_keys(tmp_path):
    """Each line: step, wall-clock time, loss, the headline lr, the caller's extras, then
    throughput, time, memory, ETA and every group's lr by name."""
    before = time.time()
    metrics = _logger(tmp_path, total_steps=5)
    metrics.log(1, 2.5, 0.5, 1000, lrs={"AdamW-default": 0.01, "Muon-group0": 0.1}, grad_norm=1.5)
    metrics.log(2, 2.0, 0.25, 1000, lrs={"AdamW-default": 0.02})
    metrics.close()
    first, second = _rows(tmp_path)
    assert list(first) == [
        *("step", "time", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"),
        *("memory_gib", "peak_memory_gib", "eta_s", "lr/AdamW-default", "lr/Muon-group0"),
    ]
    assert first["step"] == 1 and first["loss"] == 2.5 and first["grad_norm"] == 1.5
    assert before - 1 <= first["time"] <= second["time"] <= time.time() + 1
    assert first["lr"] == first["lr/AdamW-default"] == 0.01 and first["lr/Muon-group0"] == 0.1
    assert first["tokens_per_s"] == 2000 and first["step_time_s"] == 0.5
    assert first["eta_s"] == pytest.approx(0.5 * 4)
    assert first["peak_memory_gib"] >= first["memory_gib"] > 0
    assert "grad_norm" not in second and second["lr"] == 0.02
    assert second["eta_s"] == pytest.approx((0.5 + 0.25) / 2 * 3)  # mean of recent step times


def test_throughput_is_over_the_steps_since_the_last_row(tmp_path, caplog):
    """Rows at steps 1, 4 and 6: each row's tokens/s and step time cover its own window."""
    caplog.set_level(logging.INFO, logger="components.metrics")
    metrics = _logger(tmp_path, total_steps=6, log_freq=4)
    times = [0.5, 0.1, 0.2, 0.3, 0.4, 0.6]
    for step, seconds in enumerate(times, 1):
        metrics.log(step, 1.0, seconds, 100 * step, lrs={"SGD-default": 0.1})
    metrics.close()
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 4, 6]
    windows = [(0, 1), (1, 4), (4, 6)]
    for row, (a, b) in zip(rows, windows):
        tokens = sum(100 * s for s in range(a + 1, b + 1))
        assert row["tokens_per_s"] == pytest.approx(tokens / sum(times[a:b]))
        assert row["step_time_s"] == pytest.approx(sum(times[a:b]) / (b - a))
    assert "lr[SGD-default] 0.1" in caplog.text and "lr/" not in caplog.text


@pytest.mark.parametrize(
    ("log_freq", "total_steps", "logged"),
    [(1, 4, [1, 2, 3, 4]), (4, 10, [1, 4, 8, 10]), (5, 10, [1, 5, 10]), (20, 7, [1, 7])],
)
def test_log_freq_keeps_the_first_and_last_step(tmp_path, log_freq, total_steps, logged):
    metrics = _logger(tmp_path, total_steps=total_steps, log_freq=log_freq)
    for step in range(1, total_steps + 1):
        metrics.log(step, 1.0, 0.1, 10)
    metrics.close()
    assert [r["step"] for r in _rows(tmp_path)] == logged


def test_non_finite_numbers_are_null_in_the_file_but_shown_in_the_log(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="components.metrics")
    metrics = _logger(tmp_path)
    metrics.log(1, math.nan, 0.1, 10, grad_norm=math.inf, lrs={"A": -math.inf}, skipped_steps=1)
    metrics.close()
    (row,) = _rows(tmp_path)
    assert row["loss"] is None and row["grad_norm"] is None and row["lr"] is None
    assert row["skipped_steps"] == 1 and row["step"] == 1
    assert "loss nan" in caplog.text and "grad_norm inf" in caplog.text


def test_a_disabled_logger_writes_nothing(tmp_path):
    folder = tmp_path / "not-rank-0"
    metrics = _logger(folder, enabled=False)
    metrics.log(1, 1.0, 0.1, 10)
    metrics.close()
    assert not folder.exists()


def test_a_resumed_run_appends_to_the_same_file(tmp_path):
    first = _logger(tmp_path, total_steps=5)
    for step in (1, 2, 3):
        first.log(step, 3.0 - step / 10, 0.1, 10)
    first.close()
    resumed = _logger(tmp_path, total_steps=5)
    for step in (4, 5):
        resumed.log(step, 3.0 - step / 10, 0.1, 10)
    resumed.close()
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in rows] == pytest.approx([2.9, 2.8, 2.7, 2.6, 2.5])

    # Resumed from step 2 (rolled back): the rows of 3-5 go, 3-4 are logged once again.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # a row cut short by a kill
    again = MetricsLogger(Metrics(), str(tmp_path), total_steps=5, enabled=True, device=CPU)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 6  # nothing is dropped before the first step is known
    for step in (3, 4):
        again.log(step, 1.0, 0.1, 10)
    again.close()
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3, 4]
    assert [r["loss"] for r in _rows(tmp_path)][2:] == [1.0, 1.0]


def test_a_run_from_step_0_keeps_an_earlier_runs_file_aside_instead_of_dropping_its_rows(
    tmp_path, caplog
):
    earlier = _logger(tmp_path, total_steps=3)
    for step in (1, 2, 3):
        earlier.log(step, 2.0, 0.1, 10)
    earlier.close()
    fresh = _logger(tmp_path, total_steps=3)
    with caplog.at_level(logging.INFO, logger="components.metrics"):
        fresh.log(1, 1.0, 0.1, 10)
    fresh.close()
    (kept,) = tmp_path.glob("metrics.before-*.jsonl")
    assert [json.loads(r)["loss"] for r in kept.read_text().splitlines()] == [2.0, 2.0, 2.0]
    assert [r["loss"] for r in _rows(tmp_path)] == [1.0]
    assert f"kept the earlier run's {tmp_path / 'metrics.jsonl'} as {kept.name}" in caplog.text
    assert "dropped" not in caplog.text


def test_the_log_line_prints_the_checksum_with_every_digit(tmp_path, caplog):
    metrics = _logger(tmp_path, total_steps=1)
    with caplog.at_level(logging.INFO, logger="components.metrics"):
        metrics.log(1, 1.0, 0.1, 10, param_checksum=1500.8212345)
    metrics.close()
    assert "param_checksum 1500.8212345 " in caplog.text  # (4 digits would print 1501)


def _sharded_checksum(folder: str) -> dict:
    parts = three_parts(seed=3)
    params = [p for part in parts for p in part.parameters()]
    plain = param_checksum(params)
    exact = math.fsum(x for p in params for x in p.detach().double().flatten().tolist())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    shard_parts(parts, mesh, lambda part: part.children())
    sharded = [p for part in parts for p in part.parameters()]
    metrics = _logger(Path(folder), total_steps=1, enabled=dist.get_rank() == 0)
    checksum = param_checksum(sharded)
    metrics.log(1, 1.0, 0.1, 10, param_checksum=checksum)
    metrics.close()
    local = sum(p.to_local().numel() for p in sharded)
    return {"plain": plain, "exact": exact, "sharded": checksum, "local": local}


def test_param_checksum_on_two_ranks_is_the_unsharded_sum_and_rank_0_writes(tmp_path):
    """Both ranks get the sum over all shards; only the enabled rank writes its line."""
    r0, r1 = run_ranks(2, _sharded_checksum, str(tmp_path))
    total = sum(p.numel() for part in three_parts() for p in part.parameters())
    assert r0["local"] + r1["local"] == total
    assert 0 < r0["local"] < total and 0 < r1["local"] < total  # each rank holds only a shard
    for r in (r0, r1):
        assert r["plain"] == pytest.approx(r0["exact"], rel=1e-12, abs=1e-12)
        assert r["sharded"] == pytest.approx(r0["exact"], rel=1e-12, abs=1e-12)
    assert r0["sharded"] == r1["sharded"]
    (row,) = _rows(tmp_path)
    assert row["param_checksum"] == r0["sharded"]


def test_tensorboard_gets_the_scalars_of_each_row(tmp_path):
    """With enable_tensorboard, each logged row's numbers are scalars in `tb/` (read back
    through tensorboard's own reader): loss, throughput and every group's lr."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = _logger(tmp_path, total_steps=3, enable_tensorboard=True)
    for step in (1, 2, 3):
        metrics.log(step, 3.0 - step, 0.5, 100, lrs={"AdamW-default": step / 10, "Muon-group0": 1})
    metrics.close()
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert {"loss", "lr", "lr/AdamW-default", "lr/Muon-group0", "tokens_per_s"} <= set(
        events.Tags()["scalars"]
    )
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 2.0), (2, 1.0), (3, 0.0)]
    assert [e.value for e in events.Scalars("lr/AdamW-default")] == pytest.approx([0.1, 0.2, 0.3])
    assert [e.value for e in events.Scalars("tokens_per_s")] == [200.0] * 3
