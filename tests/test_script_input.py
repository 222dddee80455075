"""What `python -m scripts.plot`, `scripts.inspect` and `scripts.convert` make of bad input:
one line on stderr and exit 2, never a traceback. A `metrics.jsonl` whose last line a kill cut
short still plots, with a note; a step that train.py refuses as damaged is said to be damaged,
in train.py's words; torchft's manager state is named as torchft's.

The files are real: the dump folder of a short train.py run, a torchft run's checkpoint, and
sources written as their owners write them (torch.save, DCP), then damaged or cut as a kill,
an overwrite or a copy would.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from tests.harness.dist import REPO, run_script, train_ranks
from tests.harness.ftjob import FTJob
from tests.test_migrating import _trained
from tests.test_train import BASE

ARGS = [*BASE, "--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "1"]
GARBAGE = bytes(range(256))  # no pickle, no JSON, no zip
CONFIG = [str(Path(REPO, a)) if a.endswith(".toml") else a for a in BASE]  # from any cwd


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dump folder of a 2-step train.py run (one process) saving both steps."""
    dump = tmp_path_factory.mktemp("scripts") / "run"
    result = train_ranks(1, [*ARGS, "--job.dump_folder", str(dump)])
    assert result.returncode == 0, result.stdout[-3000:]
    return dump


def _refused(name: str, *args: str, cwd: Path, process: bool = False) -> str:
    """The one error line that `python -m scripts.<name> args` ends with, exit 2."""
    out = run_script(name, *args, cwd=cwd, process=process)
    lines = out.stderr.strip().splitlines()
    errors = [line for line in lines if "error: " in line]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(errors) == 1 and lines[-1] == errors[0], out.stderr[-3000:]
    return errors[0]


def _step_copy(run: Path, dump: Path) -> Path:
    """A copy of the run's newest step alone, in a dump folder of its own."""
    step = dump / "checkpoint" / "step-2"
    shutil.copytree(run / "checkpoint" / "step-2", step)
    return step


def _overwrite(step: Path) -> None:
    """Garbage over the step's .distcp file, of the same size: the sizes still check out."""
    (distcp,) = step.glob("*.distcp")
    size = distcp.stat().st_size
    distcp.write_bytes((GARBAGE * (size // len(GARBAGE) + 1))[:size])


def _nan_into(step: Path, key: str) -> None:
    """A NaN over the first number of `key`'s saved tensor, in place (found by its bytes)."""
    meta = dcp.FileSystemReader(step).read_metadata().state_dict_metadata[key]
    value = {key: torch.empty(meta.size, dtype=meta.properties.dtype)}
    dcp.load(value, checkpoint_id=step, no_dist=True)
    (distcp,) = step.glob("*.distcp")
    data, saved = distcp.read_bytes(), value[key].numpy().tobytes()
    at = data.index(saved)
    distcp.write_bytes(data[:at] + struct.pack("<f", float("nan")) + data[at + 4 :])


def _train_refusal(step: Path) -> str:
    """What train.py says resuming the dump folder that holds `step` (it must refuse it)."""
    resume = ["--training.steps", "3", "--job.dump_folder", str(step.parents[1])]
    refused = train_ranks(1, [*ARGS, *resume])
    assert refused.returncode == 2, refused.stdout[-3000:]
    return refused.stdout


def test_plot_skips_a_last_line_cut_short_and_names_a_line_no_run_wrote(run, tmp_path):
    rows = (run / "metrics.jsonl").read_text().splitlines()
    cut, edited, tail = tmp_path / "cut", tmp_path / "edited", tmp_path / "tail"
    for folder, text in (
        (cut, "\n".join(rows)[:-20]),  # killed while writing the last row
        (edited, "\n".join([rows[0], "garbage", rows[1]]) + "\n"),
        (tail, "\n".join([*rows, "garbage"])),  # last, but no row's start
    ):
        folder.mkdir()
        (folder / "metrics.jsonl").write_text(text)

    out = run_script("plot", str(cut), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == f"wrote {cut / 'loss.png'}: loss of 1 run"
    assert out.stderr.strip() == (
        f"note: skipped {cut / 'metrics.jsonl'}:{len(rows)}, the last line: a row cut short "
        "(as a kill while writing it leaves)"
    )
    for folder, line in ((edited, 2), (tail, len(rows) + 1)):
        assert _refused("plot", str(folder), cwd=tmp_path) == (
            f"error: {folder / 'metrics.jsonl'}:{line}: not a metrics row (a JSON object with an "
            "integer step); train.py writes none, so the file was damaged or edited: fix or "
            "delete that line"
        )


def test_inspect_says_damaged_what_train_py_refuses(run, tmp_path):
    truncated = _step_copy(run, tmp_path / "truncated")
    (distcp,) = truncated.glob("*.distcp")
    size = distcp.stat().st_size
    with distcp.open("r+b") as f:
        f.truncate(size - 4)
    damage = f"{distcp.name} is truncated: {size - 4} bytes, the .metadata needs {size}"
    line = _refused("inspect", str(truncated), cwd=tmp_path)
    assert line == f"error: {truncated} is damaged: {damage}"
    assert f"{truncated} is damaged: {damage}" in _train_refusal(truncated)

    zeroed = _step_copy(run, tmp_path / "zeroed")  # 4 KiB zeroed in place: sizes hold
    (distcp,) = zeroed.glob("*.distcp")
    with distcp.open("r+b") as f:
        f.seek(1000)
        f.write(bytes(4096))
    damage = f"{distcp.name} does not match its checksum (changed in place since its save)"
    assert _refused("inspect", str(zeroed), cwd=tmp_path) == f"error: {zeroed} is damaged: {damage}"
    assert f"{zeroed} is damaged: {damage}; nothing was loaded or changed" in (
        _train_refusal(zeroed)
    )

    nan = _step_copy(run, tmp_path / "nan")
    _nan_into(nan, "model.output.weight")
    (nan / ".checksums").unlink()  # (as a checkpoint saved before checksums were recorded)
    assert _refused("inspect", str(nan), cwd=tmp_path) == (
        f"error: {nan} is damaged: model.output.weight holds inf or NaN, which train.py "
        "refuses to load"
    )
    assert f"{nan} holds inf or NaN (first in model.output.weight)" in _train_refusal(nan)
    listed = run_script("inspect", "--quick", str(nan), cwd=tmp_path)  # reads no tensor
    assert listed.returncode == 0 and listed.stdout.startswith(f"{nan}: step 2;")

    garbled = _step_copy(run, tmp_path / "garbled")
    (garbled / ".metadata").write_bytes(GARBAGE)
    assert _refused("inspect", str(garbled), cwd=tmp_path) == (
        f"error: {garbled} is damaged: .metadata is unreadable (UnpicklingError: invalid load "
        "key, '\\x00'.)"
    )

    overwritten = _step_copy(run, tmp_path / "overwritten")
    _overwrite(overwritten)
    (overwritten / ".checksums").unlink()  # unverified: the load finds the garbage
    assert _refused("inspect", str(overwritten), cwd=tmp_path).startswith(
        f"error: {overwritten} is damaged: the folder holds values that cannot be read "
        "(rank 0: UnpicklingError: invalid load key, "
    )
    assert f"{overwritten} is damaged: the folder holds values that cannot be read" in (
        _train_refusal(overwritten)
    )


def test_inspect_names_torchft_manager_state_as_torchft(tmp_path):
    job = FTJob(tmp_path, steps=2, extra=["--fault_tolerance.group_size", "1"])
    try:
        job.start_replica(0)
        assert job.wait_exit("replica_0", timeout=180) == 0, job.log("replica_0")[-3000:]
    finally:
        job.close()
    step = tmp_path / "replica_0" / "checkpoint" / "step-2"
    out = run_script("inspect", str(step), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torchft's manager: step = 2, batches_committed = 2" in out.stdout.splitlines()
    assert "torchtitan" not in out.stdout and "ft_manager" not in out.stdout, out.stdout


@pytest.mark.slow
def test_convert_says_in_one_line_what_a_source_is_not(run, tmp_path):
    model, opt = _trained()
    flat = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    garbage, dcp_flat, sgd = tmp_path / "garbage.pt", tmp_path / "flat.pt", tmp_path / "sgd.pt"
    garbage.write_bytes(GARBAGE)
    torch.save({"model": model.state_dict(), "optimizer": flat}, dcp_flat)
    sgd_model, sgd_opt = _trained(torch.optim.SGD)
    torch.save({"model": sgd_model.state_dict(), "optimizer": sgd_opt.state_dict()}, sgd)
    foreign = tmp_path / "foreign"
    dcp.save({"encoder.weight": torch.zeros(3, 4), "epoch": 3}, checkpoint_id=foreign, no_dist=True)
    overwritten = _step_copy(run, tmp_path / "overwritten")
    _overwrite(overwritten)
    (overwritten / ".checksums").unlink()  # (saved before checksums: the load finds it)
    (tmp_path / "a_file").touch()

    def refused(
        src: Path, dst: Path | None = None, config: list[str] = CONFIG, process: bool = False
    ) -> str:
        dst = dst or tmp_path / "out"
        line = _refused("convert", str(src), str(dst), *config, cwd=tmp_path, process=process)
        assert not dst.exists()
        return line.removeprefix("ERROR error: ")

    expected = (
        "expected a dict with 'model' (a model state_dict) and 'optimizer' (torch's "
        "Optimizer.state_dict()), as torch.save wrote them"
    )
    assert refused(garbage, process=True) == (  # as a process of its own, once
        f"{garbage}: torch.load(weights_only=True) cannot read it (UnpicklingError); {expected}"
    )
    assert refused(dcp_flat).startswith(
        f"{dcp_flat}: its 'optimizer' (holding [param_groups.layers.0.attention.wk.weight.amsgrad,"
    )
    assert refused(dcp_flat).endswith(
        "is not torch's Optimizer.state_dict() ('state' by parameter id, 'param_groups' listing "
        f"those ids); {expected}"
    )
    assert refused(sgd).startswith(
        f"{sgd}: the checkpoint's optimizer state does not carry over to AdamW"
    )
    assert refused(foreign) == (
        f"SRC = '{foreign}': not a checkpoint of this project nor of torchtitan: it holds no "
        "optimizer state, and not model weights alone as torchtitan's model-only save does "
        "(also [epoch]); point it at a checkpoint saved during training by either"
    )
    assert refused(overwritten, config=[]).startswith(  # ours: converts without a config
        f"SRC = '{overwritten}' is damaged: the folder holds values that cannot be read "
        "(rank 0: UnpicklingError: invalid load key, "
    )
    into_file = tmp_path / "a_file" / "x"
    assert refused(run / "checkpoint" / "step-2", into_file, config=[]) == (
        f"DST = '{into_file}' cannot be written (rank 0: NotADirectoryError: [Errno 20] Not a "
        f"directory: '{into_file}.tmp')"
    )
