"""Checkpoints move between parallel layouts through train.py: saved at PP2 x DP2, resumed at
DP4, DP3, DP1 and PP2 x DP1; saved at DP4, resumed at PP2 x DP2 and TP2 x DP2.

The saving run is `train.py` under torchrun. Each resumed run is `train.main` on real gloo
ranks (`run_ranks`, forked from a server that imported train.py once) and hands back the state
its layout loaded, gathered at its first optimizer step before any update: it must equal the
checkpoint's bytes element for element, and its losses continue the uninterrupted run's, the
global batch fixed across data-parallel sizes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.harness.dist import run_ranks, train_ranks
from tests.harness.helpers import train_resumed
from tests.test_train import BASE, _resume_copy

GLOBAL_BATCH = 24  # dp 1, 2, 3 and 4 all divide it with local_batch_size 2
ARGS = [*BASE, "--training.global_batch_size", str(GLOBAL_BATCH), "--checkpoint.interval", "4"]
# Warmup over steps 1-6, then constant: a run that stops at step 6 has the 8-step reference's
# schedule, and a resume that lost its place in it would step at another lr.
ARGS += ["--lr_scheduler.warmup_steps", "6", "--lr_scheduler.decay_ratio", "0"]
LAYOUTS = {  # name: (ranks, [parallelism] flags)
    "dp1": (1, []),
    "dp2": (2, []),
    "dp3": (3, []),
    "dp4": (4, []),
    "pp2_dp1": (2, ["--parallelism.pipeline_parallel_degree", "2"]),
    "pp2_dp2": (4, ["--parallelism.pipeline_parallel_degree", "2"]),
    "tp2_dp2": (4, ["--parallelism.tensor_parallel_degree", "2"]),
    "fsdp1_dp3": (3, ["--parallelism.data_parallel_shard_impl", "fsdp1"]),
}


@dataclass
class Resumed:
    """A run resumed from a checkpoint: its dump folder and what each rank loaded."""

    dump: Path
    ranks: list[dict[str, Any]]


def _resume(
    src: Path, step: int, dump: Path, layout: str, steps: int, extra: tuple[str, ...] = ()
) -> Resumed:
    """Copy `src`'s step-`step` into `dump` and train on from it to `steps` at `layout`."""
    _resume_copy(src, dump, step)
    nproc, flags = LAYOUTS[layout]
    argv = [*ARGS, *extra, *flags, "--training.steps", str(steps), "--job.dump_folder", str(dump)]
    ranks = run_ranks(nproc, train_resumed, argv, timeout=240)
    assert [r["code"] for r in ranks] == [0] * nproc
    return Resumed(dump, ranks)


@dataclass
class Saved:
    ref: Path
    """The uninterrupted run at PP2 x DP2 to step 8, with step-4 and step-8."""
    dp4: Resumed
    """Its step-4 resumed at DP4 to step 6, which saved step-6 at DP4."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    root = tmp_path_factory.mktemp("reshard")
    ref = root / "pp2_dp2"
    nproc, flags = LAYOUTS["pp2_dp2"]
    argv = [*ARGS, *flags, "--training.steps", "8", "--job.dump_folder", str(ref)]
    result = train_ranks(nproc, argv)
    assert result.returncode == 0, result.stdout[-6000:]
    return Saved(ref, _resume(ref, 4, root / "dp4", "dp4", steps=6))


def _stored(dump: Path, step: int) -> dict[str, Any]:
    """A checkpoint's bytes as full tensors, read by this plain process (no job, no layout)."""
    out = dump / f"step-{step}.pt"
    if not out.exists():
        dcp_to_torch_save(dump / "checkpoint" / f"step-{step}", out)
    return torch.load(out, weights_only=False)


def _mismatches(loaded: dict[str, Any], stored: dict[str, Any]) -> dict[str, int]:
    """Elements of `stored` (a non-tensor value counts as one) that `loaded` does not hold
    equal, by key; a key only one side has counts all its elements."""
    bad = {}
    for key in loaded.keys() | stored.keys():
        a, b = loaded.get(key), stored.get(key)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            same_kind = a.shape == b.shape and a.dtype == b.dtype
            n = int((a != b).sum()) if same_kind else max(a.numel(), b.numel())
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            n = next(t for t in (a, b) if isinstance(t, torch.Tensor)).numel()
        else:
            n = int(key not in loaded or key not in stored or a != b)
        if n:
            bad[key] = n
    return bad


def _merged(ranks: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """Every rank's gathered `name` in one dict: a pipeline rank holds its stages' keys only;
    ranks that hold the same key must agree on it."""
    merged: dict[str, Any] = {}
    for rank in ranks:
        for key, value in rank[name].items():
            assert key not in merged or not _mismatches({key: value}, {key: merged[key]}), key
            merged.setdefault(key, value)
    return merged


def _tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _metrics(dump: Path) -> dict[int, dict[str, Any]]:
    """Step -> its metrics.jsonl row."""
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


def _check(
    run: Resumed, src: Path, step: int, steps: int, reference: Path, rel: float = 1e-5
) -> None:
    """`run` loaded `src`'s step-`step` element for element, and its steps up to `steps`
    continue the uninterrupted run in `reference` at the same lr and loss (within `rel`)."""
    stored = _stored(src, step)
    # Moments and step counts of every parameter and each group's lr and settings; weights.
    assert _mismatches(_merged(run.ranks, "optim"), stored["optimizer"]) == {}
    assert _mismatches(_merged(run.ranks, "model"), stored["model"]) == {}
    for rank in run.ranks:
        assert rank["step"] == step and rank["sched"] == step
        # The data position, past the first resumed step's global batch.
        assert rank["sample_index"] == (step + 1) * GLOBAL_BATCH
    got, want = _metrics(run.dump), _metrics(reference)
    assert sorted(got) == list(range(step + 1, steps + 1))
    for s, row in got.items():
        assert row["lr"] == want[s]["lr"], s
        # Reduction order differs across layouts (measured here: within 2e-7).
        assert row["loss"] == pytest.approx(want[s]["loss"], rel=rel), s


@pytest.mark.parametrize("layout", ["dp4", "dp3", "dp1", "pp2_dp1"])
@pytest.mark.slow
def test_a_pp2_dp2_checkpoint_resumes_at(layout, saved, tmp_path):
    if layout == "dp4":
        run = saved.dp4
    else:
        run = _resume(saved.ref, 4, tmp_path / layout, layout, steps=6)
    _check(run, saved.ref, 4, 6, reference=saved.ref)


@pytest.mark.parametrize("layout", ["pp2_dp2", "tp2_dp2", "fsdp1_dp3"])
@pytest.mark.slow
def test_a_dp4_checkpoint_resumes_at(layout, saved, tmp_path):
    run = _resume(saved.dp4.dump, 6, tmp_path / layout, layout, steps=8)
    _check(run, saved.dp4.dump, 6, 8, reference=saved.ref)
    if layout == "fsdp1_dp3":
        # What FSDP1 (FullyShardedDataParallel) wrote: FSDP2's keys, shapes and dtypes.
        fsdp1, fsdp2 = _stored(run.dump, 8), _stored(saved.ref, 8)
        for name in ("model", "optimizer"):
            assert {k: (v.shape, v.dtype) for k, v in fsdp1[name].items() if _tensor(v)} == {
                k: (v.shape, v.dtype) for k, v in fsdp2[name].items() if _tensor(v)
            }
            assert fsdp1[name].keys() == fsdp2[name].keys()


LEANEST = (
    "--optimizer.container", "mixed_precision", "--optimizer.moment_dtype", "8bit",
    "--mixed_precision.store_param_remainders",
)  # fmt: skip


@pytest.mark.slow
def test_remainders_with_8bit_moments_resume_bitwise_and_at_dp1_and_dp3(tmp_path):
    """The leanest state (bf16 weights, remainders, 8-bit moments) saved at DP2: resumed at
    DP2 it ends bit for bit as the uninterrupted run; at DP1 and DP3 it loads the checkpoint's
    bytes element for element (codes and scales resharded) and goes on at the same loss."""
    ref = tmp_path / "dp2"
    argv = [*ARGS, *LEANEST, "--training.steps", "6", "--job.dump_folder", str(ref)]
    result = train_ranks(2, argv)
    assert result.returncode == 0, result.stdout[-6000:]
    stored = _stored(ref, 4)["optimizer"]
    assert stored["state.layers.0.attention.wq.weight.exp_avg.code"].dtype == torch.int8
    assert "master_weights.layers.0.attention.wq.weight" in stored
    again = _resume(ref, 4, tmp_path / "again", "dp2", steps=6, extra=LEANEST)
    for part in ("optimizer", "model"):
        assert _mismatches(_stored(again.dump, 6)[part], _stored(ref, 6)[part]) == {}, part
    for layout in ("dp1", "dp3"):
        run = _resume(ref, 4, tmp_path / layout, layout, steps=6, extra=LEANEST)
        # 8-bit codes: a gradient that differs in its last bit between layouts may round a
        # code the other way, so the next loss moves a little more (measured: 1.1e-5).
        _check(run, ref, 4, 6, ref, rel=1e-4)
