"""Nothing lost, round 2 (issue 27), through train.py on 2 ranks: a skip streak saves nothing
over the good checkpoints, only `step-<N>` names are checkpoints, a full disk is one line and
a signal during start-up exits 0 (one live run per folder, and SIGHUP while training:
test_train.py). Each asserts the exit code, the one line and the checkpoint files' bytes.

The runs are train.py's ranks forked from the test server (`train_ranks`); the full disk and
the signals are processes launched as a user launches them."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch

from components.checkpoint import complete_checkpoints
from tests.harness.dist import finish, kill_tree, start, train_ranks, worker_pids
from tests.harness.helpers import poison, tmpfs
from tests.test_train import BASE, LONG, _checkpoint_tensors, _losses


def _hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` but the run lock (each run writes its record)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "run.lock"
    }


def _lines(out: str, level: str) -> list[str]:
    return [line for line in out.splitlines() if f" {level} " in line]


def _steps(dump: Path) -> list[int]:
    return [json.loads(r)["step"] for r in (dump / "metrics.jsonl").read_text().splitlines()]


def _wait(proc: subprocess.Popen, done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 120
    while not done():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} in 120 s"
        time.sleep(0.01)


def test_a_skip_streak_keeps_the_good_checkpoints_and_step_040_is_not_a_checkpoint(tmp_path):
    dump, folder = tmp_path / "run", tmp_path / "run" / "checkpoint"
    keep = ["--checkpoint.keep_latest_k", "2", "--checkpoint.interval", "2"]
    keep += ["--job.dump_folder", str(dump)]
    good = train_ranks(2, [*BASE, *keep, "--training.steps", "6"])
    assert good.returncode == 0, good.stdout[-3000:]
    assert sorted(complete_checkpoints(folder)) == [4, 6]
    shutil.copytree(folder / "step-4", folder / "step-040")  # not step 40: a stray copy
    before = _hashes(folder)

    # Step 7 at lr 1e30 commits finite but ruined weights; 8-10 are skipped. The saves due at
    # 8 and 10 would rotate step-4 and step-6 away: none is made.
    ruin = ["--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0"]
    ruin += ["--training.steps", "60", "--training.max_consecutive_skips", "3"]
    result = train_ranks(2, [*BASE, *keep, *ruin])
    out = result.stdout
    assert result.returncode == 1 and "Traceback" not in out, out[-3000:]
    assert f"resumed from {folder / 'step-6'}" in out
    strays = [line for line in _lines(out, "WARNING") if "step-040" in line]
    assert len(strays) == 1 and "not checkpoint names" in strays[0], out[-3000:]
    (error,) = _lines(out, "ERROR")
    assert "steps 8-10 were all skipped" in error, out[-3000:]
    # step-4 is the first run's: this one did not check it.
    said = f"nothing was saved during the skips; checkpoints kept in {folder} (step-6 checked "
    assert said + "finite by this run): step-4, step-6 (" in error, error
    assert _hashes(folder) == before  # step-4, step-6 and step-040, byte for byte
    assert {p.name for p in folder.iterdir()} == {"run.lock", "step-4", "step-6", "step-040"}
    assert _steps(dump) == list(range(1, 11))

    # Another seq_len on resume: one line naming both values and the fix, nothing changed.
    other = ["--training.seq_len", "16", "--training.steps", "8"]
    result = train_ranks(2, [*BASE, *keep, *other])
    assert result.returncode == 2 and "Traceback" not in result.stdout, result.stdout[-3000:]
    (error,) = _lines(result.stdout, "ERROR")
    assert "[training] seq_len = 16: the checkpoint was trained with seq_len = 32" in error
    assert "resume with --training.seq_len 32, or start a new dump folder" in error
    assert _hashes(folder) == before


def test_a_step_that_would_overflow_fp16_weights_is_skipped_and_the_stop_line_is_true(tmp_path):
    """fp16 at lr 1e30: step 1's update would overflow the fp16 weights. It is skipped before
    anything changes, as a non-finite gradient is (the weights stay finite, so no save is
    refused), every later one too, and the stop line says what is kept."""
    dump = tmp_path / "run"
    args = [*BASE, "--job.config_file", "config/mixed_precision.toml", "--job.dump_folder"]
    args += [str(dump), "--mixed_precision.param_dtype", "float16"]
    args += ["--mixed_precision.initial_scale", "4", "--optimizer.lr", "1e30"]
    args += ["--lr_scheduler.warmup_steps", "0", "--training.steps", "40"]
    args += ["--checkpoint.interval", "1", "--training.max_consecutive_skips", "3"]
    result = train_ranks(2, args)
    out = result.stdout
    assert result.returncode == 1 and "Traceback" not in out, out[-3000:]
    (stop,) = _lines(out, "ERROR")
    skips = [w for w in _lines(out, "WARNING") if "skipped" in w]
    assert [re.search(r"step (\d+) skipped", w)[1] for w in skips] == ["1", "2", "3"], out[-3000:]
    assert all("could overflow the float16 weights (AdamW at lr " in w for w in skips), skips
    assert all(re.search(r"up to [\d.]+e\+(29|30) > 65504", w) for w in skips), skips
    assert "steps 1-3 were all skipped" in stop, out[-3000:]
    assert f"kept in {dump / 'checkpoint'} (all finite): none (" in stop
    assert not complete_checkpoints(dump / "checkpoint")


# -- inf or NaN in a checkpoint, a file under a checkpoint's name (issue 47) ----------------


@pytest.mark.parametrize(
    "config, steps, word, fix",
    [
        ("mixed_precision", [10], "master_weights", "(no finite checkpoint there: the run would"),
        ("debug", [5, 10], "exp_avg_sq", "load_step = 5 and set_aside_newer = true ("),
    ],
)
def test_a_checkpoint_holding_nan_is_refused_in_one_line_before_anything(
    tmp_path, config, steps, word, fix
):
    """Once loaded, a NaN master skipped every step and the stop line called the checkpoint
    finite; a NaN moment trained NaN into the weights and the run exited 0."""
    dump, folder = tmp_path / "run", tmp_path / "run" / "checkpoint"
    args = [*BASE, "--job.config_file", f"config/{config}.toml", "--job.dump_folder", str(dump)]
    args += ["--checkpoint.interval", str(steps[0])]
    good = train_ranks(2, [*args, "--training.steps", str(steps[-1])])
    assert good.returncode == 0, good.stdout[-3000:]
    key = poison(folder / f"step-{steps[-1]}", word)
    before, config_toml = _hashes(folder), (dump / "config.toml").read_text()
    result = train_ranks(2, [*args, "--training.steps", "40"])
    out = result.stdout
    assert result.returncode == 2 and "Traceback" not in out, out[-3000:]
    (error,) = _lines(out, "ERROR")
    said = f"[checkpoint] {folder / f'step-{steps[-1]}'} holds inf or NaN (first in {key}): "
    assert said in error and "nothing was loaded or changed" in error and fix in error, error
    assert key.startswith(f"optimizer.{'master_weights' if config != 'debug' else 'state'}.")
    assert _hashes(folder) == before
    assert (dump / "config.toml").read_text() == config_toml
    assert _steps(dump) == list(range(1, steps[-1] + 1))  # not one step trained


def test_a_run_whose_last_save_was_refused_for_inf_exits_1(tmp_path):
    """lr 1e38 overflows the weights to inf at step 1 (a committed step: its gradients were
    finite); the saves of steps 1 and 2 are refused, so the run may not end as if saved."""
    dump = tmp_path / "run"
    args = [*BASE, "--job.dump_folder", str(dump), "--optimizer.lr", "1e38"]
    args += ["--lr_scheduler.warmup_steps", "0", "--training.steps", "2"]
    args += ["--checkpoint.interval", "1"]
    result = train_ranks(2, args)
    out = result.stdout
    assert result.returncode == 1 and "Traceback" not in out, out[-3000:]
    errors = _lines(out, "ERROR")
    said = [f"step-{step} not saved: inf or NaN in " for step in (1, 2)]
    assert len(errors) == 2 and all(a in e for a, e in zip(said, errors)), out[-3000:]
    assert not complete_checkpoints(dump / "checkpoint")


def test_a_file_named_step_30_stops_the_run_before_step_1_and_stays(tmp_path):
    """It was renamed step-30.old by the step-30 save, and every later start said it was
    removed while it stayed."""
    dump, folder = tmp_path / "run", tmp_path / "run" / "checkpoint"
    folder.mkdir(parents=True)
    (folder / "step-30").write_text("the user's notes")
    args = [*BASE, "--job.dump_folder", str(dump), "--training.steps", "30"]
    result = train_ranks(2, args)
    out = result.stdout
    assert result.returncode == 2 and "Traceback" not in out, out[-3000:]
    (error,) = _lines(out, "ERROR")
    assert f"[checkpoint] {folder / 'step-30'} (a file): not a checkpoint" in error, error
    assert "removed" not in out and not (dump / "metrics.jsonl").exists()
    assert sorted(p.name for p in folder.iterdir()) == ["run.lock", "step-30"]
    assert (folder / "step-30").read_text() == "the user's notes"


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 3.5 MiB tmpfs: one checkpoint of BASE's model (2.2 MB) fits, a second does not."""
    with tmpfs(tmp_path / "disk", 3584 * 1024) as disk:
        yield disk


@pytest.mark.parametrize("mode", ["disabled", "async"])
@pytest.mark.slow
def test_a_save_that_runs_out_of_disk_is_one_line_exit_1_and_the_older_one_intact(small_disk, mode):
    folder = small_disk / "checkpoint"
    args = [*BASE, "--job.dump_folder", str(small_disk), "--training.steps", "4"]
    args += ["--checkpoint.interval", "2", "--checkpoint.async_mode", mode]
    proc = start(2, args, torchrun=False)
    try:
        _wait(proc, lambda: (folder / "step-2").is_dir(), "step-2")
        before = _hashes(folder / "step-2")  # published: nothing writes it again
        result = finish(proc)
    finally:
        kill_tree(proc.pid)
    out = result.stdout
    assert result.returncode == 1 and "Traceback" not in out, out[-3000:]
    errors = _lines(out, "ERROR")
    assert len(errors) == 1, out[-3000:]
    said = re.search(
        rf"out of disk space saving step-4 in {folder}: it needs (\d+) bytes, (\d+) were free; "
        r"the partial step-4.tmp was removed and the checkpoints there stay as they were "
        r"\(step-2\)",
        errors[0],
    )
    assert said and int(said[1]) > int(said[2]), errors[0]
    assert int(said[1]) == sum(p.stat().st_size for p in (folder / "step-2").iterdir())
    assert {p.name for p in folder.iterdir()} == {"run.lock", "step-2"}
    assert _hashes(folder / "step-2") == before


def test_a_stop_in_the_middle_of_an_accumulation_resumes_bitwise(tmp_path):
    """Steps 1-2 commit, then rank 1 gets a SIGTERM after step 3's first of 4 micro-batches:
    step 2 is saved (the partial step dropped, the data back at its start), exit 0, and the
    resume trains steps 3-4 bitwise as the uninterrupted run."""
    common = [*BASE, "--training.gradient_accumulation_steps", "4", "--training.steps", "4"]
    common += ["--checkpoint.interval", "1000"]
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    for dump, faults in [(full, ()), (stopped, ("signal", "3", "1")), (stopped, ())]:
        result = train_ranks(2, [*common, "--job.dump_folder", str(dump)], faults=faults)
        assert result.returncode == 0 and "Traceback" not in result.stdout, result.stdout[-3000:]
        if faults:
            (line,) = _lines(result.stdout, "stopped by")
            assert (
                "stopped by a signal to another rank during step 3 (after 1 of its 4 "
                f"micro-batches, dropped); step 2 saved in {stopped / 'checkpoint'}, the same "
                "command resumes"
            ) in line, line
            assert sorted(complete_checkpoints(stopped / "checkpoint")) == [2]
    assert f"resumed from {stopped / 'checkpoint' / 'step-2'}" in result.stdout
    a, b = _losses(full), _losses(stopped)
    assert sorted(b) == [1, 2, 3, 4] and a == b, (a, b)
    ours, theirs = (_checkpoint_tensors(d / "checkpoint" / "step-4", d) for d in (full, stopped))
    assert ours.keys() == theirs.keys() and any(".exp_avg_sq" in k for k in ours)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), [
        k for k in ours if not torch.equal(ours[k], theirs[k])
    ]


MOE = [
    "--job.config_file", "config/moe.toml", "--model.flavor", "tiny", "--training.seq_len", "32",
    "--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2",
    "--checkpoint.interval", "2", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1",
]  # fmt: skip


def _resave(step: Path, name: str, text: str) -> None:
    """`name` in checkpoint `step` replaced by `text`, its checksum recorded again: as a run
    of that other model would have saved it."""
    import xxhash

    (step / name).write_text(text)
    sums = json.loads((step / ".checksums").read_text())
    sums["xxh3_64"][name] = xxhash.xxh3_64((step / name).read_bytes()).hexdigest()
    (step / ".checksums").write_text(json.dumps(sums))


def test_a_model_changed_in_a_setting_that_keeps_every_shape_is_refused_in_one_line(tmp_path):
    """A MoE checkpoint of top_k 1 resumed by a run of top_k 2 (every shape the same): train.py
    refuses it before step 1 in one line naming the setting, exit 2, the checkpoint as it was;
    with `--checkpoint.allow_model_changes` it resumes, saying so."""
    dump = tmp_path / "run"
    result = train_ranks(2, [*MOE, "--training.steps", "2", "--job.dump_folder", str(dump)])
    assert result.returncode == 0, result.stdout[-3000:]
    step = dump / "checkpoint" / "step-2"
    saved = json.loads((step / ".model.json").read_text())
    assert saved["model.name"] == "moe" and saved["top_k"] == 2
    _resave(step, ".model.json", json.dumps({**saved, "top_k": 1}, sort_keys=True))
    before = _hashes(step)
    resume = [*MOE, "--training.steps", "4", "--job.dump_folder", str(dump)]
    refused = train_ranks(2, resume)
    errors = _lines(refused.stdout, "ERROR")
    assert refused.returncode == 2 and "Traceback" not in refused.stdout, refused.stdout[-3000:]
    assert (
        len(errors) == 1
        and (
            f"[checkpoint] {step} holds a model with other settings (top_k 1 -> 2); nothing was "
            "loaded: resume with the checkpoint's [model] settings, or set [checkpoint] "
            "allow_model_changes = true if the change is meant"
        )
        in errors[0]
    ), errors
    assert _hashes(step) == before and sorted(complete_checkpoints(dump / "checkpoint")) == [2]
    allowed = train_ranks(2, [*resume, "--checkpoint.allow_model_changes", "true"])
    assert allowed.returncode == 0, allowed.stdout[-3000:]
    assert "holds a model with other settings (top_k 1 -> 2): loading it" in allowed.stdout


def test_a_file_changed_in_place_is_named_by_the_rank_that_hashed_it_on_every_rank(tmp_path):
    """Two ranks share the checksums of a resume (rank 1 hashes `__1_0.distcp`): 4 KiB zeroed
    in it, at the same size, stop both before step 1 with one line naming the file and the
    newest intact checkpoint, exit 2, nothing changed."""
    dump = tmp_path / "run"
    args = [*BASE, "--training.steps", "4", "--checkpoint.interval", "2"]
    result = train_ranks(2, [*args, "--job.dump_folder", str(dump)])
    assert result.returncode == 0, result.stdout[-3000:]
    step = dump / "checkpoint" / "step-4"
    with (step / "__1_0.distcp").open("r+b") as f:
        f.seek(1000)
        f.write(bytes(4096))
    before = _hashes(step)
    refused = train_ranks(2, [*args, "--training.steps", "6", "--job.dump_folder", str(dump)])
    errors = _lines(refused.stdout, "ERROR")
    assert refused.returncode == 2 and "Traceback" not in refused.stdout, refused.stdout[-3000:]
    assert len(errors) == 1, refused.stdout[-3000:]
    said = "__1_0.distcp does not match its checksum (changed in place since its save)"
    newest = "load_step = 2 and set_aside_newer = true (moves the newer steps aside); intact: [2]"
    assert said in errors[0] and errors[0].endswith(newest), errors[0]
    assert _hashes(step) == before


MIXED = ["--job.config_file", "config/mixed_precision.toml"]
LEAN = ["--optimizer.moment_dtype", "bfloat16", "--mixed_precision.store_param_remainders"]
IN_BACKWARD = ["--optimizer.early_step_in_backward", "--training.max_norm", "0"]
IN_BACKWARD += ["--mixed_precision.grad_accumulation_dtype", "param_dtype"]


@pytest.mark.parametrize(
    "mode, extra",
    [
        ("async", MIXED),
        ("async", [*MIXED, *LEAN]),
        ("async", [*MIXED, *IN_BACKWARD]),
        ("async_with_pinned_mem", MIXED),
    ],
    ids=["fp32_masters", "bf16_moments_remainders", "in_backward", "pinned_mem"],
)
def test_async_saves_under_mixed_precision_are_written_and_resume_bitwise(tmp_path, mode, extra):
    """The masters and moments are views of flat buffers, held by DTensors: both async saves
    are written (DCP's own stager took such a DTensor for a tensor with storage and failed
    on every rank, leaving no checkpoint), and a resume from step-3 ends at step 6 with every
    saved tensor bitwise the uninterrupted run's."""
    common = [*BASE, *extra, "--training.steps", "6", "--checkpoint.interval", "3"]
    common += ["--checkpoint.async_mode", mode]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    for dump in (full, resumed):
        if dump == resumed:
            (resumed / "checkpoint").mkdir(parents=True)
            shutil.copytree(full / "checkpoint" / "step-3", resumed / "checkpoint" / "step-3")
        result = train_ranks(2, [*common, "--job.dump_folder", str(dump)])
        out = result.stdout
        assert result.returncode == 0 and "Traceback" not in out, out[-3000:]
        assert not _lines(out, "ERROR"), out[-3000:]
        assert sorted(complete_checkpoints(dump / "checkpoint")) == [3, 6]
    assert f"resumed from {resumed / 'checkpoint' / 'step-3'}" in out
    a, b = _losses(full), _losses(resumed)
    assert sorted(b) == [4, 5, 6] and [a[s] for s in b] == [b[s] for s in b]
    ours, theirs = (_checkpoint_tensors(d / "checkpoint" / "step-6", d) for d in (full, resumed))
    assert ours.keys() == theirs.keys()
    assert any(".exp_avg_sq" in k for k in ours) and any("master_weights." in k for k in ours)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), [
        k for k in ours if not torch.equal(ours[k], theirs[k])
    ]


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler for `sig` (its start-up reached train.py's)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(re.search(r"SigCgt:\s*([0-9a-f]+)", status)[1], 16)
    return bool(mask >> (sig - 1) & 1)


def _started(proc: subprocess.Popen, phase: str) -> bool:
    """Whether the launcher (`phase` "launcher") or both ranks ("ranks") of `proc` have
    train.py's first handler in: they are importing torch or building, not training yet."""
    if phase == "launcher":
        return _catches(proc.pid, signal.SIGTERM)
    ranks = worker_pids(proc.pid).values()
    return len(ranks) == 2 and all(_catches(p, signal.SIGTERM) for p in ranks)


@pytest.mark.slow
def test_a_signal_during_start_up_exits_0_in_one_line(tmp_path):
    # While the launcher, then while the ranks, import torch and build: exit 0, one line.
    for phase, said in [("launcher", "before the ranks started"), ("ranks", "before step 1")]:
        dump = tmp_path / phase
        proc = start(2, [*BASE, "--job.dump_folder", str(dump), *LONG], torchrun=False)
        try:
            _wait(proc, partial(_started, proc, phase), f"{phase} started")
            os.kill(proc.pid, signal.SIGTERM)
            result = finish(proc)
        finally:
            kill_tree(proc.pid)
        stops = [line for line in result.stdout.splitlines() if "stopped by" in line]
        assert result.returncode == 0 and "Traceback" not in result.stdout, result.stdout
        assert len(stops) == 1 and f"stopped by SIGTERM {said}" in stops[0], result.stdout
        assert not complete_checkpoints(dump / "checkpoint")
