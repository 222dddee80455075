"""Defaults that run, config errors before any process group, and hangs that end (issue 13)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
import torch.distributed as dist

from components.job import build_job, validate_job
from config import ConfigError, JobConfig, load_job_config
from tests.harness.dist import REPO, free_port, kill_tree, launch, run_here, train_ranks
from tests.test_train import BASE


def _error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if " ERROR " in line]


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_lists_the_keys_and_reads_nothing(flag, capsys):
    """`train.py --help` prints the keys and returns (exit 0) before reading any file."""
    import train

    train.main(["--job.config_file", "nope.toml", flag])
    out = capsys.readouterr().out
    assert out.startswith("usage: train.py [--nproc_per_node N]")
    assert "\n  --nproc_per_node N   start N ranks on this machine" in out  # the launcher's own
    assert "\n[training]\n  steps: int = 200\n" in out
    assert "train_timeout_seconds: int = 100" in out


def test_no_arguments_run_the_debug_job(tmp_path):
    """The defaults alone (no config file) train; an empty TOML gives the same config
    (tests/config/test_defaults.py)."""
    argv = ["--training.steps", "2", "--lr_scheduler.warmup_steps", "1"]
    result = train_ranks(1, [*argv, "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, result.stdout[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] < rows[0]["loss"]


FSDP1 = ["--parallelism.data_parallel_shard_impl", "fsdp1"]
FP32_SUMS = ["--optimizer.container", "mixed_precision"]
FP32_SUMS += ["--mixed_precision.grad_accumulation_dtype", "float32"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--training.seq_len", "4096"],
            "[training] seq_len = 4096: above the 1024 positions of llama flavor 'debug'; "
            "use seq_len <= 1024 or a flavor with more (tiny: 256, debug: 1024, small: 2048)",
        ),
        (["--training.dataset", "c4"], "[training] dataset = 'c4': not a llama dataset"),
        (["--model.num_parts", "5"], "[model] num_parts = 5: llama flavor 'debug' has 4 layers"),
        (["--model.flavor", "huge"], "[model] flavor = 'huge': unknown flavor"),
        (["--optimizer.container", "x"], "[optimizer] container = 'x': unknown container"),
        (["--training.global_batch_size", "12"], "global_batch_size = 12: not a multiple"),
        (
            ["--optimizer.momentum", "0.9"],
            "[optimizer] momentum = 0.9: AdamW takes no momentum, so it would be ignored; remove "
            "it, or use an optimizer that reads it (Muon, SGD)",
        ),
        (
            [
                *("--fault_tolerance.enable", "--fault_tolerance.group_size", "2"),
                *("--fault_tolerance.min_replica_size", "3"),
            ],
            "[fault_tolerance] min_replica_size = 3: above group_size = 2, the replica groups "
            "this job can have, so no step could ever commit; use min_replica_size <= 2",
        ),
        (
            ["--optimizer.ns_dtype", "bfloat16"],
            "[optimizer] ns_dtype = 'bfloat16': AdamW takes no ns_dtype, so it would be ignored",
        ),
        (
            ["--training.global_batch_size", "0"],
            "[training] global_batch_size = 0: expected -1 (derived) or a multiple of "
            "local_batch_size 8 x 1 data-parallel ranks, at least 8",
        ),
        (
            ["--training.seed", "99999999999999999999999"],
            "[training] seed = 99999999999999999999999: out of range; use a value <= "
            "18446744073709551615",
        ),
        *(
            (
                [f"--fault_tolerance.{key}", "99999999999999999999"],
                f"[fault_tolerance] {key} = 99999999999999999999: out of range; use a value "
                "<= 604800000",
            )
            for key in ("connect_timeout_ms", "quorum_timeout_ms", "process_group_timeout_ms")
        ),
        (
            ["--training.local_batch_size", "99999999999999999999"],
            "[training] local_batch_size = 99999999999999999999: out of range; use a value "
            "<= 1048576",
        ),
        (
            ["--training.local_batch_size", "1000000"],
            "[training] local_batch_size = 1000000: its activations need about 5142.2 GiB "
            "(seq_len 128, flavor 'debug'), above the",
        ),
        (
            [*FSDP1, "--parallelism.tensor_parallel_degree", "2"],
            "data_parallel_shard_impl = 'fsdp1' with tensor_parallel_degree = 2",
        ),
        (
            [*FSDP1, "--optimizer.early_step_in_backward"],
            "[parallelism] data_parallel_shard_impl = 'fsdp1' with [optimizer] "
            "early_step_in_backward = true: FSDP1 computes gradients on its flat parameters",
        ),
        (
            [*FSDP1, "--fault_tolerance.enable"],
            "'fsdp1' with [fault_tolerance] enable = true",
        ),
        (
            [*FSDP1, "--optimizer.name", "Muon"],
            "'fsdp1' with [optimizer] name = 'Muon': FSDP1 hands the optimizer 1-D slices",
        ),
        (
            [*FSDP1, "--training.mixed_precision_reduce", "bfloat16"],
            "'fsdp1' with [training] mixed_precision_reduce = 'bfloat16': that is FSDP2's mixed "
            "precision policy; use data_parallel_shard_impl = 'fsdp2' or set",
        ),
        (
            [
                *("--fault_tolerance.enable", "--fault_tolerance.semi_sync_method", "diloco"),
                *("--fault_tolerance.sync_steps", "2", "--fault_tolerance.num_fragments", "3"),
            ],
            "[fault_tolerance] num_fragments = 3: more than sync_steps = 2 (each fragment syncs "
            "on a step of its own); use at most 2",
        ),
        (
            [
                "--optimizer.container",
                "mixed_precision",
                "--training.mixed_precision_param",
                "bfloat16",
            ],
            "[training] mixed_precision_param = 'bfloat16': container 'mixed_precision' keeps its "
            "parameters in [mixed_precision] param_dtype 'bfloat16' already",
        ),
        (
            [*FP32_SUMS, "--optimizer.early_step_in_backward", "--training.max_norm", "0"],
            "[optimizer] early_step_in_backward = true with [mixed_precision] "
            "grad_accumulation_dtype = 'float32': units step inside backward from their bf16 "
            "gradients, while the fp32 sums are stepped after backward; set "
            "early_step_in_backward = false or use grad_accumulation_dtype 'param_dtype'",
        ),
        (
            [*FP32_SUMS, "--fault_tolerance.enable"],
            "[mixed_precision] grad_accumulation_dtype = 'float32' with [fault_tolerance] enable "
            "= true: torchft averages the bf16",
        ),
        (
            ["--training.mixed_precision_reduce", "bfloat16"],
            "[training] mixed_precision_reduce = 'bfloat16': FSDP2's mixed precision applies where "
            "FSDP2 shards, but data_parallel_shard_degree 1 and data_parallel_replicate_degree 1 "
            "leave nothing to shard; run 2 or more data-parallel ranks",
        ),
    ],
)
def test_what_the_job_cannot_run_is_refused_before_any_process_group(args, message):
    with pytest.raises(ConfigError) as refused:
        validate_job(load_job_config(args))
    assert message in str(refused.value)
    assert not dist.is_initialized()


# Integers the loop only counts or compares with, in Python: no bound reaches torch or a kernel.
COUNTERS = {
    "training.steps", "training.max_consecutive_skips", "metrics.log_freq",
    "checkpoint.interval", "checkpoint.keep_latest_k", "checkpoint.load_step",
    "ema.update_every_n_steps", "ema.start_step", "ema.eval_every",
}  # fmt: skip


def _int_keys(cls: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += _int_keys(hints[f.name], f"{prefix}{f.name}.")
        elif hints[f.name] in (int, int | None):
            keys.append(f"{prefix}{f.name}")
    return keys


@pytest.mark.parametrize("key", _int_keys(JobConfig))
def test_every_integer_has_a_bound_before_any_process_group(key):
    """10**20 in any integer key (with the feature it belongs to on) is refused in one line
    naming the key, or the key is one the loop only counts with (`COUNTERS`)."""
    on = {
        "fault_tolerance": ["--fault_tolerance.enable", "--fault_tolerance.lighthouse", "x:1"],
        "ema": ["--ema.enable"],
        "mixed_precision": [
            "--optimizer.container",
            "mixed_precision",
            "--mixed_precision.param_dtype",
            "float16",
        ],
        "parallelism.pipeline_parallel_microbatch_size": [
            "--parallelism.pipeline_parallel_degree",
            "2",
        ],
    }
    on = on.get(key, on.get(key.split(".")[0], []))
    args = ["--job.config_file", "config/debug.toml", *on, f"--{key}", str(10**20)]
    if key in COUNTERS:
        validate_job(load_job_config(args), 2)
        return
    with pytest.raises(ConfigError) as refused:
        validate_job(load_job_config(args), 2)
    said = str(refused.value)
    assert key.split(".")[-1] in said and str(10**20) in said, said
    assert "\n" not in str(refused.value)


def test_a_refused_ft_job_never_connects(tmp_path):
    """An unknown optimizer under torchft is refused before the lighthouse (a closed port
    here, which would cost torchft's connect timeout) or any store is contacted."""
    port = free_port()
    cfg = load_job_config(
        [
            *("--fault_tolerance.enable", "--optimizer.name", "Adamm"),
            *("--fault_tolerance.lighthouse", f"http://127.0.0.1:{port}"),
            *("--job.dump_folder", str(tmp_path)),
        ]
    )
    store_port = os.environ.get("MASTER_PORT")  # build_job starts a store after validating
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"\[optimizer\] name = 'Adamm': unknown optimizer"):
        build_job(cfg)
    assert time.monotonic() - start < 5
    assert not dist.is_initialized() and os.environ.get("MASTER_PORT") == store_port


def _refused_line(args: list[str], dump: Path, process: bool = False) -> str:
    """The one line `train.py --nproc_per_node 2 args` prints when the launcher refuses the
    config (exit 2, before any rank starts): stderr alone, with its final newline, nothing on
    stdout and nothing written under `dump`. In this process (the launcher's check is
    `train.run`'s), or as a `process` of its own."""
    argv = ["--nproc_per_node", "2", *args, "--job.dump_folder", str(dump)]
    if process:
        result = subprocess.run(
            [sys.executable, "train.py", *argv], cwd=REPO, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
    else:
        result = run_here(argv)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == "" and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.endswith("\n") and not dump.exists()
    return result.stderr.partition(" ERROR error: ")[2].removesuffix("\n")


@pytest.mark.slow
def test_a_retired_key_is_one_line_naming_its_replacement_before_any_rank(tmp_path):
    """`[mixed_precision] compile` went: `[optimizer] implementation = "compiled"` is the one
    compile knob. The launcher refuses it (exit 2) before it starts a rank or a folder."""
    args = ["--job.config_file", "config/mixed_precision.toml", "--mixed_precision.compile"]
    assert _refused_line(args, tmp_path / "run", process=True) == (
        "[mixed_precision] compile: retired; set [optimizer] implementation = "
        "'compiled' (one inductor graph a param group, under every container) instead, and "
        "leave this key out"
    )


DILOCO = ["--fault_tolerance.enable", "--fault_tolerance.semi_sync_method", "diloco"]
DILOCO += ["--fault_tolerance.sync_steps", "4"]
OFF = "(with the feature off, only its default {} is accepted)"


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["--ema.decay", "0.5"],
            "[ema] decay = 0.5: only [ema] enable = true reads it, and enable = false; set "
            f"[ema] enable = true or remove [ema] decay {OFF.format(0.9999)}",
        ),
        (
            ["--fault_tolerance.sync_steps", "4"],
            "[fault_tolerance] sync_steps = 4: only [fault_tolerance] semi_sync_method = "
            "'diloco' reads it, and semi_sync_method = 'none'; set [fault_tolerance] "
            f"semi_sync_method = 'diloco' or remove [fault_tolerance] sync_steps {OFF.format(100)}",
        ),
        (
            ["--fault_tolerance.enable", "--fault_tolerance.num_fragments", "4"],
            "[fault_tolerance] num_fragments = 4: only [fault_tolerance] semi_sync_method = "
            "'diloco' reads it, and semi_sync_method = 'none'; set [fault_tolerance] "
            "semi_sync_method = 'diloco' or remove [fault_tolerance] num_fragments "
            + OFF.format(1),
        ),
        (
            [*DILOCO, "--fault_tolerance.outer_optimizer", "Nope"],
            "[fault_tolerance] outer_optimizer = 'Nope': unknown optimizer; registered: "
            "Adafactor, Adagrad, Adam, AdamW, Adamax, Muon, NAdam, RAdam, SGD (add one with "
            "components.optimizer.register_optimizer)",
        ),
        (
            [*DILOCO, "--fault_tolerance.outer_optimizer", "Muon"],
            "[fault_tolerance] outer_optimizer = 'Muon': Muon takes 2-D parameters and 3-D "
            "stacks of matrices (one per expert) only; got a parameter of shape (128,) (the "
            "outer step updates "
            "every parameter of the model); pick one that takes them all, e.g. 'SGD' (DiLoCo's "
            "Nesterov momentum, the default)",
        ),
        (
            ["--training.steps", "5", "--lr_scheduler.warmup_steps", "10"],
            "[lr_scheduler] warmup_steps = 10: more than [training] steps = 5, so the lr would "
            "never reach its peak; use warmup_steps <= 5 or train longer",
        ),
    ],
    ids=[
        "ema_key_without_ema",
        "diloco_key_without_ft",
        "diloco_key_without_diloco",
        "unknown_outer_optimizer",
        "muon_outer_optimizer",
        "warmup_above_steps",
    ],
)
def test_a_config_decision_is_one_line_under_its_key_before_any_rank_or_connection(
    tmp_path, args, line
):
    """Issue 47 (7, 8): a key set for a feature that is off and DiLoCo's outer optimizer (a
    closed lighthouse port: checked before torchft would wait for it) are refused by the
    launcher, named where they were written."""
    lighthouse = ["--fault_tolerance.lighthouse", f"http://127.0.0.1:{free_port()}"]
    args += lighthouse if "--fault_tolerance.enable" in args else []
    assert _refused_line(args, tmp_path / "run") == line


@pytest.mark.slow
def test_a_bad_config_under_torchrun_is_one_line_from_rank_0(tmp_path):
    result = launch(2, [*BASE, "--job.dump_folder", str(tmp_path), "--training.seq_len", "300"])
    out = result.stdout
    assert result.returncode != 0  # torchrun itself exits 1 for any failed worker
    lines = _error_lines(out)
    assert len(lines) == 1 and "error: [training] seq_len = 300: above the 256" in lines[0], out
    assert 'train.py", line' not in out  # torchrun's own traceback is all there is
    # torchrun's summary names rank 0 as the root cause, with the line instead of a link.
    cause = out.split("Root Cause")[1]
    assert "rank      : 0" in cause and "exitcode  : 2" in cause and "seq_len = 300" in cause


def _worker_pid(launcher: int, local_rank: int) -> int:
    """The pid of the train.py worker with `local_rank` under the torchrun `launcher`."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == launcher and f"LOCAL_RANK={local_rank}".encode() in env:
            return int(entry)
    raise AssertionError(f"no worker with LOCAL_RANK={local_rank} under pid {launcher}")


@pytest.mark.parametrize("when", ["start-up", "training"])
@pytest.mark.slow
def test_a_stopped_rank_is_named_as_not_answering_within_the_timeout(tmp_path, when):
    """SIGSTOP one rank while the processes start (then `init_timeout_seconds` holds) or
    after the first step (`train_timeout_seconds`, not gloo's 30 min): the other says that a
    rank did not answer, naming what waited, and exits; the launcher then exits nonzero."""
    args = [*BASE, "--job.dump_folder", str(tmp_path), "--training.steps", "1000"]
    args += ["--comm.train_timeout_seconds", "3", "--comm.init_timeout_seconds", "5"]
    args += ["--checkpoint.enable", "false"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    log = tmp_path / "out.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [*cmd, "train.py", *args],
            cwd=REPO,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    metrics = tmp_path / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120
        # start-up: as soon as the worker exists; training: step 2 logged (the first step is
        # done, so the train timeout is in force).
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            if (
                when == "training"
                and metrics.exists()
                and len(metrics.read_text().splitlines()) >= 2
            ):
                break
            if when == "start-up" and _has_worker(proc.pid, local_rank=1):
                break
            time.sleep(0.02)
        worker = _worker_pid(proc.pid, local_rank=1)
        os.kill(worker, signal.SIGSTOP)
        stopped = time.monotonic()
        while not _error_lines(log.read_text()):
            assert time.monotonic() - stopped < 30, log.read_text()[-3000:]
            time.sleep(0.05)
        # Rank 0 exits at once; torchrun would wait 30 s for the stopped one to end.
        os.kill(worker, signal.SIGKILL)
        assert proc.wait(timeout=30) != 0
    finally:
        kill_tree(proc.pid)
        proc.wait(timeout=30)
    (line,) = _error_lines(log.read_text())
    assert "got no answer in time: a rank stopped responding" in line, line
    if when == "training":
        assert re.search(r"collective gloo:\w+ #\d+ \(.*timeout 3 s\) got no answer in time", line)
    else:
        assert "wait timeout after 5000ms" in line, line


def _has_worker(launcher: int, local_rank: int) -> bool:
    try:
        _worker_pid(launcher, local_rank)
    except AssertionError:
        return False
    return True
