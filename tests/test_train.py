"""train.py end to end: resume, crash during a save, bad input, signals, a live folder
(resharding across layouts: test_reshard.py).

A run whose subject is the run is train.py's ranks forked from the test server
(`train_ranks`); a kill, a signal, a lock between processes or a launcher is tested on
processes started as a user starts them (`start`: torchrun or train.py's launcher)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from components.checkpoint import complete_checkpoints
from config import ConfigError
from tests.harness.dist import finish, kill_tree, run_here, start, train_ranks, worker_pids
from tests.harness.ftjob import FTJob

BASE = [
    "--job.config_file",
    "config/debug.toml",
    "--model.flavor",
    "tiny",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--lr_scheduler.warmup_steps",
    "1",
    "--checkpoint.interval",
    "10",
    "--checkpoint.keep_latest_k",
    "0",
    "--metrics.log_freq",
    "1",
]


def _losses(dump: Path) -> dict[int, float]:
    """Step -> loss from metrics.jsonl (a resumed run appends; the last line of a step wins)."""
    lines = (dump / "metrics.jsonl").read_text().splitlines()
    return {(r := json.loads(line))["step"]: r["loss"] for line in lines}


def _run(nproc: int, dump: Path, *extra: str) -> str:
    result = train_ranks(nproc, [*BASE, "--job.dump_folder", str(dump), *extra])
    assert result.returncode == 0, result.stdout[-6000:]
    return result.stdout


def _resume_copy(src: Path, dst: Path, step: int) -> None:
    (dst / "checkpoint").mkdir(parents=True)
    shutil.copytree(src / "checkpoint" / f"step-{step}", dst / "checkpoint" / f"step-{step}")


def _final_model(dump: Path, step: int) -> dict[str, torch.Tensor]:
    return torch.load(dump / "checkpoint" / f"model-step-{step}.pt", weights_only=True)


def _hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` but the run lock (each run writes its record)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "run.lock"
    }


def _mtimes(folder: Path) -> dict[Path, int]:
    """Modification times under `folder`, but the run lock's (each run writes its record)."""
    return {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.name != "run.lock"}


def test_resume_at_the_same_world_size_is_bitwise(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _run(2, full, "--training.steps", "20", "--checkpoint.export_model")
    _resume_copy(full, resumed, 10)
    out = _run(2, resumed, "--training.steps", "20", "--checkpoint.export_model")
    assert "resumed from" in out and "step-10" in out
    a, b = _losses(full), _losses(resumed)
    assert sorted(b) == list(range(11, 21))
    assert [a[s] for s in b] == [b[s] for s in b]  # bitwise: floats from the same bits
    assert a[20] < a[1] - 1.0
    ma, mb = _final_model(full, 20), _final_model(resumed, 20)
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)


@pytest.mark.slow
def test_sigkill_during_a_save_resumes_from_the_last_complete_checkpoint(tmp_path):
    dump = tmp_path / "run"
    args = [
        *BASE,
        "--job.dump_folder",
        str(dump),
        "--model.flavor",
        "small",  # ~25M params: a save takes long enough to be caught in the middle
        "--training.seq_len",
        "16",
        "--training.local_batch_size",
        "1",
        "--training.steps",
        "6",
        "--checkpoint.interval",
        "2",
    ]
    proc = start(2, args, stdout=subprocess.DEVNULL)
    ckpt = dump / "checkpoint"
    deadline = time.monotonic() + 240
    try:
        while not (ckpt / "step-4.tmp").exists():
            assert proc.poll() is None, "training ended before the save could be interrupted"
            assert time.monotonic() < deadline, "no save of step 4 started in time"
            time.sleep(0.001)
        kill_tree(proc.pid)
    finally:
        kill_tree(proc.pid)
        proc.wait(timeout=30)
    assert (ckpt / "step-2").is_dir() and not (ckpt / "step-4").exists()

    out = train_ranks(2, args).stdout
    assert "resumed from" in out and "step-2" in out, out[-4000:]
    # The rows of steps 3-4 from before the kill were dropped on resume: none is there twice.
    rows = (dump / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["step"] for row in rows] == list(range(1, 7))
    assert {p.name for p in ckpt.iterdir()} == {"run.lock", "step-2", "step-4", "step-6"}


@pytest.mark.slow
def test_a_second_run_on_a_live_dump_or_checkpoint_folder_exits_2_and_changes_no_byte(tmp_path):
    """One live run (train.py's launcher, paused while the others try): a second run on its
    dump folder, and one on its checkpoint folder named by another path (a symlink), each exit
    2 in one line and change no byte; the first finishes untouched."""
    dump, shared, link = tmp_path / "a", tmp_path / "shared", tmp_path / "link"
    link.symlink_to(shared)  # the third run names the same folder by another path
    common = [*BASE, "--training.steps", "12", "--checkpoint.interval", "2"]
    common += ["--checkpoint.keep_latest_k", "3"]
    first = start(
        2,
        [*common, "--job.dump_folder", str(dump), "--checkpoint.folder", str(shared)],
        torchrun=False,
    )
    lock = dump / "run.lock"
    try:
        deadline = time.monotonic() + 120
        while not (shared / "step-2").is_dir():
            assert first.poll() is None and time.monotonic() < deadline, "run 1 saved no step-2"
            time.sleep(0.02)
        # Paused, so it is surely still live while the others start; nothing else.
        kill_tree(first.pid, signal.SIGSTOP)
        holder = json.loads(lock.read_text())
        holder_of_shared = json.loads((shared / "run.lock").read_text())
        before = _hashes(shared)
        t0 = time.monotonic()
        same_dump = train_ranks(1, [*common, "--job.dump_folder", str(dump)], timeout=60)
        elapsed = time.monotonic() - t0
        other = [
            *common,
            "--job.dump_folder",
            str(tmp_path / "b"),
            "--checkpoint.folder",
            str(link),
        ]
        same_folder = train_ranks(1, other, timeout=120)
        after = _hashes(shared)
    finally:
        kill_tree(first.pid, signal.SIGCONT)
    out, _ = first.communicate(timeout=240)
    assert same_dump.returncode == 2 and elapsed < 30, (elapsed, same_dump.stdout[-3000:])
    errors = [line for line in same_dump.stdout.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "Traceback" not in same_dump.stdout, same_dump.stdout
    assert f"dump_folder: {dump} is in use by a live run (pid {holder['pid']} " in errors[0]
    assert f"on host {holder['host']}, started {holder['started']}" in errors[0]

    holder = holder_of_shared
    assert same_folder.returncode == 2 and "Traceback" not in same_folder.stdout
    errors = [line for line in same_folder.stdout.splitlines() if " ERROR " in line]
    assert len(errors) == 1, same_folder.stdout[-3000:]
    assert (
        f"[checkpoint] folder: {shared} is in use by a live run (pid {holder['pid']} on host "
        f"{holder['host']}, started {holder['started']}, dump folder {dump}; lock "
    ) in errors[0]
    assert after == before and any(k.startswith("step-2/") for k in before)
    assert (tmp_path / "b" / "run.lock").read_text() == ""  # its dump folder freed again

    assert first.returncode == 0 and "Traceback" not in out, out[-4000:]
    lines = (dump / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 13))
    assert sorted(complete_checkpoints(shared)) == [8, 10, 12]
    assert lock.read_text() == ""  # released at exit
    # The refused run logged before it knew the folder was not its own: none of it there.
    assert "step    12" in (log := (dump / "train.log").read_text()) and "in use" not in log


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--training.steps", "-1"], r"\[training\] steps = -1: out of range; use a value >= 1"),
        (["--job.config_file", "nope.toml"], r"config_file = 'nope.toml': cannot read it"),
        (["--optimizer.nmae", "AdamW"], r"unknown key 'nmae'; did you mean 'name'"),
        (["--optimizer.container", "x"], r"container = 'x': unknown container"),
        (["--training.global_batch_size", "7"], r"global_batch_size = 7: not a multiple"),
        (
            ["--training.steps", "3", "--lr_scheduler.warmup_steps", "5"],
            r"warmup_steps = 5: more than \[training\] steps = 3, .*use warmup_steps <= 3",
        ),
    ],
)
def test_bad_config_is_one_clear_line_and_nonzero_exit(tmp_path, args, message):
    result = train_ranks(1, [*BASE, "--job.dump_folder", str(tmp_path), *args], timeout=60)
    assert result.returncode == 2
    assert "Traceback" not in result.stdout
    errors = [line for line in result.stdout.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and re.search(message, errors[0]), result.stdout


def test_an_older_load_step_leaves_every_newer_file_byte_identical(tmp_path):
    _run(2, tmp_path, "--training.steps", "4", "--checkpoint.interval", "2")
    folder = tmp_path / "checkpoint"
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert {p.parent.name for p in before} >= {"step-2", "step-4"}
    args = ["--training.steps", "6", "--checkpoint.interval", "2", "--checkpoint.load_step", "2"]
    result = train_ranks(2, [*BASE, "--job.dump_folder", str(tmp_path), *args])
    assert result.returncode != 0, result.stdout[-3000:]
    assert "load_step = 2:" in result.stdout and "also holds step-4" in result.stdout
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


def test_checkpoint_of_another_model_is_refused_before_anything_changes(tmp_path):
    _run(0, tmp_path, "--training.steps", "2", "--checkpoint.interval", "1")
    before = _mtimes(tmp_path / "checkpoint")
    result = train_ranks(1, [*BASE, "--job.dump_folder", str(tmp_path), "--model.flavor", "debug"])
    assert result.returncode == 2 and "Traceback" not in result.stdout, result.stdout[-3000:]
    assert "does not match this job" in result.stdout
    assert "missing keys [model.layers.2.attention.wk.weight" in result.stdout
    assert "shape mismatches [model.layers.0.attention.wk.weight" in result.stdout
    after = _mtimes(tmp_path / "checkpoint")
    assert before == after

    # A damaged newest checkpoint: named with its file and the fix, never skipped for step-1.
    with open(tmp_path / "checkpoint" / "step-2" / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    log = tmp_path / "train.log"  # the one file that changes: it says why
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p != log}
    logged = log.read_text()
    result = train_ranks(1, [*BASE, "--job.dump_folder", str(tmp_path), "--training.steps", "3"])
    assert result.returncode == 2 and "Traceback" not in result.stdout, result.stdout[-3000:]
    errors = [line for line in result.stdout.splitlines() if "ERROR" in line]
    assert len(errors) == 1, result.stdout
    assert re.search(r"step-2 is damaged: __0_0\.distcp is truncated: 1000 bytes", errors[0])
    assert "load_step = 1 and set_aside_newer = true" in errors[0]
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p != log} == before
    assert log.read_text().startswith(logged) and errors[0] in log.read_text()


def test_accumulation_follows_the_global_batch_across_ranks_and_replica_groups():
    from config import accumulation_steps, load_job_config

    argv = ["--training.global_batch_size", "16", "--training.local_batch_size", "2"]
    assert accumulation_steps(load_job_config(argv).training, 2) == 4
    assert accumulation_steps(load_job_config(argv).training, 4) == 2  # e.g. 2 groups x 2 ranks
    assert accumulation_steps(load_job_config(argv[2:]).training, 4) == 1  # no global batch: as set
    with pytest.raises(ConfigError, match=r"global_batch_size = 16: not a multiple"):
        accumulation_steps(load_job_config(argv).training, 3)
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps = 3: .* implies 4"):
        accumulation_steps(
            load_job_config([*argv, "--training.gradient_accumulation_steps", "3"]).training, 2
        )


# -- non-finite numbers ---------------------------------------------------------------------


def _checkpoint_tensors(step_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, out)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False))
    return flat


# A dynamic loss scale of 4 halving to its floor 1 at every overflow: the skips at steps 2 and
# 3 back the scale off (they do not count); 4, 5 and 6, at the floor, do. (bf16: with fp16 the
# weights lr 1e30 writes at step 1 are out of range, inf in the step-1 checkpoint.)
DYNAMIC_FLOOR = [
    *("--mixed_precision.loss_scaling", "dynamic", "--mixed_precision.initial_scale", "4"),
    *("--mixed_precision.min_scale", "1", "--mixed_precision.hysteresis", "1"),
]


@pytest.mark.parametrize(
    "config, extra, last",
    [
        ("config/debug.toml", [], 4),
        ("config/in_backward.toml", [], 4),
        ("config/mixed_precision.toml", DYNAMIC_FLOOR, 6),
    ],
    ids=["default", "in_backward", "mixed_precision_dynamic_scale_at_its_floor"],
)
def test_lr_1e30_stops_at_the_skip_cap_with_exit_1_and_only_finite_checkpoints(
    tmp_path, config, extra, last
):
    dump = tmp_path / "run"
    args = [*BASE, "--job.config_file", config, "--job.dump_folder", str(dump), *extra]
    args += ["--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0"]
    args += ["--training.steps", "40", "--training.max_consecutive_skips", "3"]
    args += ["--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0"]
    result = train_ranks(2, args)
    assert result.returncode == 1, result.stdout[-3000:]
    errors = [line for line in result.stdout.splitlines() if " ERROR " in line]
    expected = f"steps {last - 2}-{last} were all skipped"
    assert len(errors) == 1 and expected in errors[0], result.stdout[-3000:]
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, last + 1))  # strict JSON: NaN is null
    assert rows[1]["loss"] is None and rows[-1]["skipped_steps"] == last - 1
    if extra:
        assert [r["loss_scale"] for r in rows] == [4.0, 2.0, 1.0, 1.0, 1.0, 1.0]
    # Saved at step 1; none inside the streak (the state did not change), so none rotated.
    assert [p.name for p in (dump / "checkpoint").glob("step-*")] == ["step-1"]
    assert "(all finite): step-1 (" in errors[0]
    tensors = _checkpoint_tensors(dump / "checkpoint" / "step-1", tmp_path)
    assert all(t.isfinite().all() for t in tensors.values())


# -- preemption -----------------------------------------------------------------------------

LONG = ["--training.steps", "60", "--checkpoint.interval", "1000", "--metrics.log_freq", "1"]


def _wait_for_steps(proc: subprocess.Popen, dump: Path, steps: int = 3) -> None:
    deadline = time.monotonic() + 120
    while not (dump / "metrics.jsonl").exists() or len(_losses(dump)) < steps:
        assert proc.poll() is None and time.monotonic() < deadline, "it did not train"
        time.sleep(0.02)


def _stop_while_training(
    dump: Path, signal_to: str, sig: signal.Signals
) -> tuple[subprocess.CompletedProcess, int]:
    """Start a 2-rank run, send `sig` to `signal_to` once it trains: "launcher" (train.py's
    own) or "rank1" (under torchrun, which exits 1 when signalled itself)."""
    args = [*BASE, "--job.dump_folder", str(dump), *LONG]
    proc = start(2, args, torchrun=signal_to != "launcher")
    try:
        _wait_for_steps(proc, dump)
        pid = proc.pid if signal_to == "launcher" else worker_pids(proc.pid)[1]
        os.kill(pid, sig)
        result = finish(proc, timeout=120)
    finally:
        kill_tree(proc.pid)
    return result, max(_losses(dump))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    """The losses of the LONG run, never stopped."""
    ref = tmp_path_factory.mktemp("ref")
    _run(2, ref, *LONG)
    return _losses(ref)


@pytest.mark.parametrize(
    "signal_to, sig, said",
    [("rank1", signal.SIGTERM, "a signal to another rank"), ("launcher", signal.SIGHUP, "SIGHUP")],
    ids=["sigterm_to_rank1_under_torchrun", "sighup_to_the_launcher"],
)
@pytest.mark.slow
def test_a_stop_signal_saves_the_step_reached_exits_0_and_the_same_command_resumes_bitwise(
    tmp_path, signal_to, sig, said, uninterrupted
):
    """SIGTERM to one rank under torchrun, or SIGHUP (the terminal closed) to train.py's
    launcher, which passes it on to every rank."""
    run = tmp_path / "run"
    result, reached = _stop_while_training(run, signal_to, sig)
    assert result.returncode == 0 and "Traceback" not in result.stdout, result.stdout[-3000:]
    assert reached < 60 and list(complete_checkpoints(run / "checkpoint")) == [reached]
    lines = [line for line in result.stdout.splitlines() if "stopped by" in line]
    assert len(lines) == 1, result.stdout[-3000:]
    assert f"stopped by {said} at step {reached} of 60" in lines[0], lines[0]
    out = _run(2, run, *LONG)
    assert f"step-{reached}" in out
    assert _losses(run) == uninterrupted  # bitwise, every step


def _ft_losses(folder: Path, script: tuple[str, ...]) -> tuple[dict[int, float], str]:
    job = FTJob(folder, steps=6, extra=["--fault_tolerance.group_size", "1"])
    try:
        job.start_replica(0, script)
        assert job.wait_exit("replica_0", timeout=180) == 0, job.log("replica_0")[-3000:]
    finally:
        job.close()
    return {s: row["loss"] for s, row in job.metrics(0).items()}, job.log("replica_0")


def test_a_step_torchft_does_not_commit_is_retried_on_the_same_batch_bitwise(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    clean, _ = _ft_losses(tmp_path / "a", ("train.py",))
    retried, log = _ft_losses(tmp_path / "b", ("-m", "tests.harness.faults", "fail", "3"))
    assert "step 3 was not committed" in log and "running it again on the same batch" in log
    assert sorted(clean) == list(range(1, 7)) and retried == clean  # bitwise


@pytest.mark.parametrize("torchrun", [True, False], ids=["torchrun", "train.py"])
@pytest.mark.slow
def test_sigkill_of_the_launcher_alone_leaves_no_rank_alive(tmp_path, torchrun):
    proc = start(2, [*BASE, "--job.dump_folder", str(tmp_path), *LONG], torchrun=torchrun)
    ranks: dict[int, int] = {}
    try:
        _wait_for_steps(proc, tmp_path)
        ranks = worker_pids(proc.pid)
        assert len(ranks) == 2
        _kill_launcher_alone(proc, ranks, within=10)
    finally:
        _end(proc, ranks)


@pytest.mark.slow
def test_ranks_whose_launcher_died_while_they_started_exit(tmp_path):
    """train.py's launcher SIGKILLed as soon as its ranks exist (still importing torch): they
    exit as they reach train.main, rather than wait for the process group until the init
    timeout (300 s) with the launcher's store gone."""
    proc = start(2, [*BASE, "--job.dump_folder", str(tmp_path), *LONG], torchrun=False)
    ranks: dict[int, int] = {}
    try:
        # (bounds for a loaded machine: each waits for a condition, ending when it holds)
        deadline = time.monotonic() + 120
        while len(ranks) < 2:
            assert time.monotonic() < deadline, "the launcher started no ranks"
            ranks = worker_pids(proc.pid)
        _kill_launcher_alone(proc, ranks, within=120)
        assert not (tmp_path / "checkpoint").exists()
    finally:
        _end(proc, ranks)


def _kill_launcher_alone(proc: subprocess.Popen, ranks: dict[int, int], within: float) -> None:
    """SIGKILL the launcher only (its ranks run in their own sessions); every rank must have
    ended `within` seconds later."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + within
    while any(_alive(pid) for pid in ranks.values()):
        assert time.monotonic() < deadline, f"a rank outlived its launcher by {within} s"
        time.sleep(0.05)


def _end(proc: subprocess.Popen, ranks: dict[int, int]) -> None:
    """Whatever is left of a launcher and its ranks, killed."""
    kill_tree(proc.pid)
    for pid in ranks.values():
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def _checkpoint(dump: Path, step: int, tmp: Path) -> dict:
    """A checkpoint as saved, read without building a job (which would apply its config)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(dump / "checkpoint" / f"step-{step}", tmp / f"step-{step}.pt")
    return torch.load(tmp / f"step-{step}.pt", weights_only=False)


def test_a_resume_takes_every_optimizer_setting_from_the_config(tmp_path):
    dump = tmp_path / "run"
    _run(0, dump, "--training.steps", "2")  # AdamW: lr 3e-3, betas (0.9, 0.95), wd 0.1

    # Another state layout: refused before anything changes, in one line.
    before = _mtimes(dump / "checkpoint")
    sgd = ["--training.steps", "3", "--optimizer.name", "SGD", "--optimizer.momentum", "0.9"]
    result = train_ranks(1, [*BASE, "--job.dump_folder", str(dump), *sgd], timeout=120)
    errors = [line for line in result.stdout.splitlines() if "ERROR" in line]
    assert result.returncode == 2 and "Traceback" not in result.stdout, result.stdout[-3000:]
    assert len(errors) == 1, result.stdout[-3000:]
    for part in ["SGD: it keeps [exp_avg, exp_avg_sq, step]", "SGD keeps [momentum_buffer]"]:
        assert part in errors[0] and "[optimizer] name" in errors[0], errors[0]
    assert _mtimes(dump / "checkpoint") == before

    # Every setting changed, Adam for AdamW: lr 1e-30 moves no weight by a single ulp.
    changed = ["--optimizer.name", "Adam", "--optimizer.lr", "1e-30", "--optimizer.beta1", "0.8"]
    changed += ["--optimizer.beta2", "0.99", "--optimizer.eps", "1e-6"]
    changed += ["--optimizer.weight_decay", "0.01", "--training.steps", "3"]
    out = _run(0, dump, *changed)
    lines = [line for line in out.splitlines() if "resume: from the config" in line]
    assert len(lines) == 1, out[-3000:]
    for change in [
        "lr 0.003 -> 1e-30,",  # the base lr that the schedule scales
        "betas (0.9, 0.95) -> (0.8, 0.99)",
        "eps 1e-08 -> 1e-06",
        "weight_decay 0.1 -> 0.01,",  # the no-decay group keeps 0.0: not a change
        "optimizer AdamW -> Adam",
    ]:
        assert change in lines[0], lines[0]

    # Step 3 ran from the saved state at the new settings, and saved them.
    old, new = _checkpoint(dump, 2, tmp_path), _checkpoint(dump, 3, tmp_path)
    assert new["optimizer"]["state.layers.0.attention.wq.weight.step"].item() == 3
    groups = {k: v for k, v in new["optimizer"].items() if k.startswith("param_groups.")}
    assert {k.rsplit(".", 1)[1] for k in groups} >= {"lr", "betas", "eps", "weight_decay"}
    for key, value in groups.items():
        name = key.rsplit(".", 1)[1]
        no_decay = "norm" in key or "tok_embeddings" in key
        want = {
            "betas": (0.8, 0.99),
            "eps": 1e-6,
            "weight_decay": 0.0 if no_decay else 0.01,
            "decoupled_weight_decay": False,
            "initial_lr": 1e-30,
        }
        assert value == want.get(name, value), key
        if name == "lr":
            assert 0 < value <= 1e-30, key  # the lr of step 4 on this run's schedule
    assert old["model"].keys() == new["model"].keys()
    assert all(torch.equal(old["model"][k], new["model"][k]) for k in old["model"])


def test_the_launcher_refuses_a_bad_config_in_one_line_before_any_rank_starts(tmp_path):
    args = ["--nproc_per_node", "2", *BASE, "--job.dump_folder", str(tmp_path)]
    result = run_here([*args, "--model.flavor", "nope"])
    said = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in said, said[-3000:]
    lines = [line for line in said.splitlines() if line.strip()]
    assert len(lines) == 1 and "ERROR" in lines[0] and "flavor" in lines[0], said
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # no rank ran


def test_muon_toml_trains_with_muon_on_the_block_matrices_and_checkpoints_its_momentum(
    tmp_path,
):
    """config/muon.toml through train.py (one process): one container steps the attention and
    feed-forward matrices with Muon and the rest with AdamW; its momentum is in the checkpoint
    under the flat keys."""
    args = ["config/muon.toml" if a == "config/debug.toml" else a for a in BASE]
    result = train_ranks(1, [*args, "--job.dump_folder", str(tmp_path), "--training.steps", "2"])
    assert result.returncode == 0, result.stdout[-3000:]
    assert "OptimizersContainer([ShardedMuon (float32 state) x2, AdamW (float32 state) x3]" in (
        result.stdout
    )
    assert list(_losses(tmp_path)) == [1, 2] and _losses(tmp_path)[2] < _losses(tmp_path)[1]
    state = _checkpoint(tmp_path, 2, tmp_path)["optimizer"]
    muon = {k.split(".", 1)[1].rsplit(".", 1)[0] for k in state if k.endswith(".momentum_buffer")}
    assert muon == {
        f"layers.{i}.{w}.weight"
        for i in range(2)
        for w in [*(f"attention.w{x}" for x in "qkvo"), *(f"feed_forward.w{x}" for x in "123")]
    }
    assert all(state[f"state.{fqn}.momentum_buffer"].abs().sum() > 0 for fqn in muon)
    assert {"tok_embeddings.weight", "norm.weight", "output.weight"} == {
        k[len("state.") : -len(".exp_avg")]
        for k in state
        if k.endswith(".exp_avg") and "layers." not in k
    }


@pytest.mark.slow
def test_a_stop_signal_during_a_long_accumulation_is_obeyed_within_seconds(tmp_path):
    """100000 micro-batches a step (minutes): a SIGTERM to the launcher ends the run within
    seconds, between micro-batches, the partial step dropped and said in one line, exit 0."""
    log = tmp_path / "out.log"
    args = [*BASE, "--job.dump_folder", str(tmp_path / "run")]
    args += ["--training.gradient_accumulation_steps", "100000"]
    with log.open("w") as out:
        proc = start(2, args, torchrun=False, stdout=out)
        try:
            deadline = time.monotonic() + 120
            while "100000 micro-batches/step" not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            time.sleep(1.0)  # in the middle of step 1's micro-batches
            os.kill(proc.pid, signal.SIGTERM)
            sent = time.monotonic()
            code = proc.wait(timeout=60)
            seconds = time.monotonic() - sent
        finally:
            kill_tree(proc.pid)
    text = log.read_text()
    assert code == 0 and seconds < 10, (code, seconds, text[-3000:])
    assert "received SIGTERM: stopping at the next micro-batch" in text
    (line,) = [line for line in text.splitlines() if "stopped by" in line]
    assert re.search(
        r"stopped by (SIGTERM|a signal to another rank) during step 1 \(after \d+ of its 100000 "
        r"micro-batches, dropped\); no step was committed: nothing to save",
        line,
    ), line
