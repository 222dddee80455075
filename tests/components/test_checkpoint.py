"""CheckpointManager: atomic publish, discovery, retention, async saves, refusals, export."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from components.checkpoint import (
    CheckpointManager,
    ModelWrapper,
    SaveFailed,
    TrainState,
    complete_checkpoints,
)
from components.run_lock import RunLock
from config import Checkpoint, ConfigError
from containers import OptimizersContainer, ShadowWeights
from tests.harness.dist import run_ranks
from tests.harness.helpers import assert_same, forward, full, poison, three_parts, tmpfs, train


def _job(
    folder: Path, seed: int = 0, **cfg
) -> tuple[list, OptimizersContainer, TrainState, CheckpointManager]:
    parts = three_parts(seed)
    if dist.is_initialized():
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for part in parts:
            fully_shard(part, mesh=mesh)
    optimizers = OptimizersContainer(parts, torch.optim.AdamW, {"lr": 1e-2})
    state = TrainState()
    states = {"model": ModelWrapper(parts), "optimizer": optimizers, "train_state": state}
    manager = CheckpointManager(Checkpoint(enable=True, **cfg), str(folder), states, total_steps=7)
    return parts, optimizers, state, manager


def _snapshot(parts, optimizers) -> dict:
    model = {f"{i}.{k}": full(v) for i, p in enumerate(parts) for k, v in p.state_dict().items()}
    return {**model, **{k: full(v) for k, v in optimizers.state_dict().items()}}


def _train_and_save(manager, parts, optimizers, state, steps: range) -> None:
    for step in steps:
        train(parts, optimizers, 1, start=step)
        state.step = step
        manager.maybe_save(step)


def _run_to_the_end(manager, parts, optimizers, state, steps: range) -> str | None:
    """`steps` trained and saved, then the manager closed: the line a save stopped it with."""
    try:
        _train_and_save(manager, parts, optimizers, state, steps)
        manager.close()
    except SaveFailed as e:
        return str(e)
    return None


def test_saves_at_interval_and_end_keeps_latest_k_and_resumes_newest(tmp_path):
    parts, optimizers, state, manager = _job(tmp_path, interval=2, keep_latest_k=2)
    assert manager.load() == 0
    _train_and_save(manager, parts, optimizers, state, range(1, 8))
    manager.close()
    assert sorted(complete_checkpoints(tmp_path / "checkpoint")) == [6, 7]
    expected = _snapshot(parts, optimizers)

    parts2, optimizers2, state2, manager2 = _job(tmp_path, seed=5, interval=2)
    assert manager2.load() == 7 and state2.step == 7
    assert_same(_snapshot(parts2, optimizers2), expected)


def test_load_step_picks_one_and_a_missing_one_lists_the_available(tmp_path):
    parts, optimizers, state, manager = _job(tmp_path, interval=3)
    _train_and_save(manager, parts, optimizers, state, range(1, 4))
    at_three = _snapshot(parts, optimizers)
    _train_and_save(manager, parts, optimizers, state, range(4, 7))
    parts_b, optimizers_b, state_b, manager_b = _job(tmp_path, seed=3, interval=3, load_step=3)
    assert manager_b.load(read_only=True) == 3 and state_b.step == 3
    assert_same(_snapshot(parts_b, optimizers_b), at_three)
    with pytest.raises(ConfigError, match=r"load_step = 4: no complete checkpoint.*\[3, 6\]"):
        _job(tmp_path, interval=3, load_step=4)[3].load()


def test_an_unpublished_save_is_removed_at_start_and_never_resumed(tmp_path):
    parts, optimizers, state, manager = _job(tmp_path, interval=2)
    _train_and_save(manager, parts, optimizers, state, range(1, 3))
    expected = _snapshot(parts, optimizers)
    folder = tmp_path / "checkpoint"
    # What a kill during a save leaves: step-4.tmp, here even with its .metadata written.
    (folder / "step-4.tmp").mkdir()
    (folder / "step-4.tmp" / ".metadata").write_bytes(
        (folder / "step-2" / ".metadata").read_bytes()
    )
    assert list(complete_checkpoints(folder)) == [2]

    # Without the folder's lock the writer may be live: left alone.
    assert _job(tmp_path, seed=9, interval=2)[3].load() == 2
    assert (folder / "step-4.tmp" / ".metadata").is_file()

    parts2, optimizers2, state2, manager2 = _job(tmp_path, seed=9, interval=2)
    lock = RunLock(folder)  # as build_job takes it: whoever wrote step-4.tmp is dead
    lock.acquire()
    try:
        assert manager2.load() == 2
    finally:
        lock.release()
    assert not (folder / "step-4.tmp").exists()  # a stale .tmp is removed at start
    assert_same(_snapshot(parts2, optimizers2), expected)
    _train_and_save(manager2, parts2, optimizers2, state2, range(3, 5))
    assert not (folder / "step-4.tmp").exists() and list(complete_checkpoints(folder)) == [2, 4]


def _truncate(step: Path) -> None:
    with open(step / "__0_0.distcp", "r+b") as f:
        f.truncate(f.seek(0, 2) - 1)  # one byte short of what the metadata references


def _zero_in_place(step: Path) -> None:
    with open(step / "__0_0.distcp", "r+b") as f:
        f.seek(100)
        f.write(bytes(4096))  # the same size: only the checksum tells


def _empty(step: Path) -> None:
    for path in step.iterdir():
        path.unlink()


DAMAGE = {
    "truncated .distcp": (
        _truncate,
        r"__0_0\.distcp is truncated: \d+ bytes, the \.metadata needs",
    ),
    "changed in place": (
        _zero_in_place,
        r"__0_0\.distcp does not match its checksum \(changed in place since its save\)",
    ),
    "garbage checksums": (
        lambda s: (s / ".checksums").write_text("{"),
        r"\.checksums is unreadable \(JSONDecodeError",
    ),
    "missing .distcp": (lambda s: (s / "__0_0.distcp").unlink(), r"__0_0\.distcp is missing"),
    "missing .metadata": (lambda s: (s / ".metadata").unlink(), r"\.metadata is missing"),
    "garbage .metadata": (
        lambda s: (s / ".metadata").write_bytes(b"garbage"),
        r"\.metadata is unreadable \(UnpicklingError",
    ),
    "empty step folder": (_empty, r"the folder is empty"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_checkpoint_is_named_with_its_file_and_fix_before_anything_changes(
    tmp_path, case
):
    parts, optimizers, state, manager = _job(tmp_path, interval=2)
    _train_and_save(manager, parts, optimizers, state, range(1, 5))
    folder = tmp_path / "checkpoint"
    damage, problem = DAMAGE[case]
    damage(folder / "step-4")
    before = _tree_bytes(folder)
    parts2, optimizers2, state2, manager2 = _job(tmp_path, seed=9, interval=2)
    fresh = _snapshot(parts2, optimizers2)
    fix = r"load_step = 2 and set_aside_newer = true .*; intact: \[2\]$"
    with pytest.raises(ConfigError, match=rf"step-4 is damaged: {problem}.*{fix}") as error:
        manager2.load()  # never a silent fallback to step-2
    assert "\n" not in str(error.value)
    assert _tree_bytes(folder) == before and {p.name for p in folder.iterdir()} == {
        "step-2",
        "step-4",
    }
    assert_same(_snapshot(parts2, optimizers2), fresh) and state2.step == 0
    # The fix the line names works: step-4 moves aside and training goes on from step-2.
    manager3 = _job(tmp_path, interval=2, load_step=2, set_aside_newer=True)[3]
    assert manager3.load() == 2 and not (folder / "step-4").exists()


def test_a_checkpoint_saved_before_checksums_loads_and_says_it_is_unverified(tmp_path, caplog):
    parts, optimizers, state, manager = _job(tmp_path, interval=2)
    _train_and_save(manager, parts, optimizers, state, range(1, 3))
    step = tmp_path / "checkpoint" / "step-2"
    assert json.loads((step / ".checksums").read_text())["xxh3_64"].keys() == {
        p.name for p in step.iterdir() if p.name != ".checksums"
    }
    (step / ".checksums").unlink()
    caplog.set_level("INFO", logger="components.checkpoint.manager")
    assert _job(tmp_path, seed=9, interval=2)[3].load() == 2
    assert any("records no checksums" in r.getMessage() for r in caplog.records)


def test_a_model_with_other_settings_of_the_same_shapes_is_refused_unless_allowed(tmp_path, caplog):
    """MoE top_k 2 -> 1 keeps every shape: only the recorded settings tell."""
    parts, optimizers, state, manager = _job(tmp_path, interval=2)
    manager.model_settings = {"model.name": "moe", "top_k": 2}
    _train_and_save(manager, parts, optimizers, state, range(1, 3))
    parts2, optimizers2, state2, manager2 = _job(tmp_path, seed=9, interval=2)
    manager2.model_settings = {"model.name": "moe", "top_k": 1}
    fresh = _snapshot(parts2, optimizers2)
    with pytest.raises(ConfigError) as refused:
        manager2.load()
    assert str(refused.value) == (
        f"[checkpoint] {tmp_path / 'checkpoint' / 'step-2'} holds a model with other settings "
        "(top_k 2 -> 1); nothing was loaded: resume with the checkpoint's [model] settings, "
        "or set [checkpoint] allow_model_changes = true if the change is meant"
    )
    assert_same(_snapshot(parts2, optimizers2), fresh) and state2.step == 0
    manager3 = _job(tmp_path, seed=9, interval=2, allow_model_changes=True)[3]
    manager3.model_settings = {"model.name": "moe", "top_k": 1}
    assert manager3.load() == 2
    assert any(
        "other settings (top_k 2 -> 1): loading it" in r.getMessage() for r in caplog.records
    )
    # The same checkpoint as a seed of another folder's run.
    saved = tmp_path / "checkpoint" / "step-2"
    other = _job(tmp_path / "other", seed=9, interval=2, initial_load_path=str(saved))[3]
    other.model_settings = {"model.name": "moe", "top_k": 1}
    with pytest.raises(ConfigError) as refused:
        other.load()
    assert str(refused.value) == (
        f"[checkpoint] initial_load_path = '{saved}' holds a model with other settings "
        "(top_k 2 -> 1); nothing was loaded: run with the checkpoint's [model] settings, "
        "or set [checkpoint] allow_model_changes = true if the change is meant"
    )


def test_an_unwritable_folder_is_refused_before_step_one(tmp_path):
    # A file where the folder should be: unwritable even for root (chmod is not).
    (tmp_path / "checkpoint").write_text("not a folder")
    with pytest.raises(ConfigError, match=r"\[checkpoint\] folder: .* is not writable"):
        _job(tmp_path)[3].load()
    assert (tmp_path / "checkpoint").read_text() == "not a folder"


def _tree_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_an_older_load_step_never_destroys_newer_checkpoints(tmp_path):
    parts, optimizers, state, manager = _job(tmp_path, interval=2, keep_latest_k=2)
    _train_and_save(manager, parts, optimizers, state, range(1, 7))
    folder = tmp_path / "checkpoint"
    before = _tree_bytes(folder)
    assert sorted(complete_checkpoints(folder)) == [4, 6]
    parts2, optimizers2, state2, manager2 = _job(tmp_path, seed=5, interval=2, load_step=4)
    fresh = _snapshot(parts2, optimizers2)
    with pytest.raises(ConfigError, match=r"load_step = 4: .* also holds step-6, which a run"):
        manager2.load()
    assert _tree_bytes(folder) == before  # nothing moved, nothing loaded
    assert_same(_snapshot(parts2, optimizers2), fresh) and state2.step == 0

    # Opted in: step-6 moves aside byte for byte; training on rotates nothing newer away.
    parts3, optimizers3, state3, manager3 = _job(
        tmp_path, seed=5, interval=2, keep_latest_k=2, load_step=4, set_aside_newer=True
    )
    assert manager3.load() == 4
    (aside,) = folder.glob("aside-*-from-step-4")
    assert _tree_bytes(aside) == {k: v for k, v in before.items() if k.startswith("step-6")}
    _train_and_save(manager3, parts3, optimizers3, state3, range(5, 7))
    assert sorted(complete_checkpoints(folder)) == [4, 6] and aside.is_dir()


def test_resaving_a_step_after_resuming_earlier_replaces_it(tmp_path):
    parts, optimizers, state, manager = _job(tmp_path, interval=2)
    _train_and_save(manager, parts, optimizers, state, range(1, 5))
    parts2, optimizers2, state2, manager2 = _job(
        tmp_path, interval=2, load_step=2, set_aside_newer=True
    )
    manager2.load()
    train(parts2, optimizers2, 1, start=100)  # a different step 3 than the first run's
    train(parts2, optimizers2, 1, start=101)
    state2.step = 4
    manager2.maybe_save(4)
    expected = _snapshot(parts2, optimizers2)
    parts3, optimizers3, _, manager3 = _job(tmp_path, seed=2, interval=2)
    assert manager3.load() == 4
    assert_same(_snapshot(parts3, optimizers3), expected)
    names = {p.name for p in (tmp_path / "checkpoint").iterdir()}
    assert {"step-2", "step-4"} < names and any(n.startswith("aside-") for n in names)


def test_mismatched_checkpoint_is_refused_before_anything_changes(tmp_path):
    parts, optimizers, state, manager = _job(tmp_path, interval=1)
    _train_and_save(manager, parts, optimizers, state, range(1, 2))
    other = [torch.nn.Linear(10, 3)]
    other_opt = OptimizersContainer(other, torch.optim.AdamW, {"lr": 1e-2})
    before = {k: full(v) for k, v in other[0].state_dict().items()}
    wrong = CheckpointManager(
        Checkpoint(enable=True),
        str(tmp_path),
        {"model": ModelWrapper(other), "optimizer": other_opt, "train_state": TrainState()},
        total_steps=1,
    )
    with pytest.raises(ConfigError, match=r"missing keys \[model\.bias, model\.weight"):
        wrong.load()
    assert_same({k: full(v) for k, v in other[0].state_dict().items()}, before)
    assert not dict(other_opt.state)


def test_a_refused_load_leaves_the_ema_in_the_state_dict(tmp_path):
    """The load fits the EMA out of DCP's template (the checkpoint has none) before the keys
    are compared; when they do not match, the container is as it was: its EMA still saved."""
    parts, optimizers, state, manager = _job(tmp_path, interval=1)
    _train_and_save(manager, parts, optimizers, state, range(1, 2))  # no EMA in it
    other = [torch.nn.Linear(10, 3)]
    other_opt = OptimizersContainer(other, torch.optim.AdamW, {"lr": 1e-2}, ema=ShadowWeights(0.9))
    other[0](torch.ones(2, 10)).sum().backward()
    other_opt.step()
    before = other_opt.state_dict()
    assert any(k.startswith("ema.") for k in before)
    wrong = CheckpointManager(
        Checkpoint(enable=True),
        str(tmp_path),
        {"model": ModelWrapper(other), "optimizer": other_opt, "train_state": TrainState()},
        total_steps=1,
    )
    with pytest.raises(ConfigError, match="missing keys"):
        wrong.load()
    assert_same(other_opt.state_dict(), before)


def test_a_checkpoint_with_an_ema_into_a_run_without_says_the_ema_fix_alone(tmp_path):
    parts = three_parts()
    optimizers = OptimizersContainer(parts, torch.optim.AdamW, {"lr": 1e-2}, ema=ShadowWeights(0.9))
    state = TrainState()
    states = {"model": ModelWrapper(parts), "optimizer": optimizers, "train_state": state}
    manager = CheckpointManager(Checkpoint(enable=True, interval=1), str(tmp_path), states, 7)
    _train_and_save(manager, parts, optimizers, state, range(1, 2))
    _, _, _, plain = _job(tmp_path)
    with pytest.raises(ConfigError) as refused:
        plain.load()
    message = str(refused.value)
    assert "keep one ([ema] enable = true)" in message and "[optimizer] name" not in message


def test_export_writes_the_full_model_in_one_file(tmp_path):
    parts, optimizers, _, manager = _job(tmp_path, interval=1)
    train(parts, optimizers, 2)
    path = manager.export_model(parts, step=2)
    saved = torch.load(path, weights_only=True)
    assert_same(saved, {k: v for p in parts for k, v in p.state_dict().items()})


def _published_without_another_call(step: Path) -> float:
    """Seconds until `step` is published while the trainer makes no checkpoint call."""
    start = time.monotonic()
    while not (step / ".metadata").is_file() or step.with_suffix(".tmp").exists():
        assert time.monotonic() - start < 60, f"{step} not published after its save completed"
        time.sleep(0.01)
    return time.monotonic() - start


def _async_round_trip(folder: str) -> dict:
    parts, optimizers, state, manager = _job(Path(folder), interval=2, async_mode="async")
    snapshots = {}
    for step in range(1, 5):
        train(parts, optimizers, 1, rank=dist.get_rank(), start=step)
        state.step = step
        snapshots[step] = _snapshot(parts, optimizers)
        manager.maybe_save(step)  # returns at once
        if step == 2 and dist.get_rank() == 0:
            # Published as soon as complete, not at the next save: a kill now keeps it.
            _published_without_another_call(Path(folder) / "checkpoint" / "step-2")
    manager.close()
    parts2, optimizers2, _, manager2 = _job(Path(folder), seed=4, interval=2, load_step=2)
    manager2.load(read_only=True)
    at_two = _snapshot(parts2, optimizers2)
    return {
        "two": at_two,
        "expected_two": snapshots[2],
        "found": list(complete_checkpoints(Path(folder) / "checkpoint")),
    }


def test_async_saves_are_published_as_soon_as_complete_on_two_ranks(tmp_path):
    result = run_ranks(2, _async_round_trip, str(tmp_path))[0]
    assert result["found"] == [2, 4]
    assert_same(result["two"], result["expected_two"])


def _manager_lines() -> list[str]:
    """What the checkpoint manager logs from now on, a `LEVEL message` line each."""
    import logging

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(f"{record.levelname} {record.getMessage()}")
    logging.getLogger("components.checkpoint.manager").addHandler(handler)
    return lines


def _saves_with_files_in_the_way(folder: str, mode: str) -> dict:
    """Steps 1-7, saves every 2 and at 7; files where step-2.tmp and step-7.tmp go."""
    lines = _manager_lines()
    parts, optimizers, state, manager = _job(Path(folder), interval=2, async_mode=mode)
    checkpoints = Path(folder) / "checkpoint"
    if dist.get_rank() == 0:
        checkpoints.mkdir(parents=True, exist_ok=True)
        for step in (2, 7):
            (checkpoints / f"step-{step}.tmp").write_text("not a directory")
    dist.barrier()
    stopped = _run_to_the_end(manager, parts, optimizers, state, range(1, 8))
    return {
        "lines": lines,
        "found": list(complete_checkpoints(checkpoints)),
        "stopped": stopped,
        "step": state.step,
    }


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_failed_save_is_one_line_and_training_goes_on_and_a_failed_last_one_stops(tmp_path, mode):
    """A save that cannot be written (here: a file where its folder goes) is one error line
    and the run trains on; the later saves are written; a failed last save stops the run in
    one line naming the checkpoint the same command resumes from."""
    results = run_ranks(2, _saves_with_files_in_the_way, str(tmp_path), mode)
    ours, other = results
    folder = tmp_path / "checkpoint"
    errors = [line for line in ours["lines"] if line.startswith("ERROR")]
    assert len(errors) == 1 and not [x for x in other["lines"] if x.startswith("ERROR")]
    assert errors[0].startswith("ERROR [checkpoint] step-2 not saved (rank "), errors
    assert f"the checkpoints in {folder} stay as they were (none); training goes on" in errors[0]
    assert ours["step"] == other["step"] == 7 and ours["found"] == [4, 6]
    for result in results:
        assert result["stopped"].startswith("[checkpoint] step-7 not saved (rank ")
        assert "stay as they were (step-4, step-6); the run stops: the same command resumes " \
            "from step-6" in result["stopped"]  # fmt: skip
        assert "\n" not in result["stopped"]


def _save_step_2(folder: str, mode: str) -> dict:
    """Steps 1-2 of `_job` on each rank, saved at 2, then closed: what stopped the run (one
    line, or None) and the files of each checkpoint folder entry."""
    parts, optimizers, state, manager = _job(Path(folder), interval=2, async_mode=mode)
    stopped = _run_to_the_end(manager, parts, optimizers, state, range(1, 3))
    checkpoints = Path(folder) / "checkpoint"
    found = {p.name: sorted(f.name for f in p.iterdir()) for p in checkpoints.iterdir()}
    return {"stopped": stopped, "found": found}


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_disk_full_when_the_checksums_are_written_is_one_line_on_every_rank(tmp_path, mode):
    """A disk with room for the saved files but not their checksum record: both ranks stop
    with the same out-of-disk line (a sync save hashes each rank's own files, rank 0 writes
    the record; an async one writes it from DCP's thread), and no partial save stays."""
    probe = run_ranks(2, _save_step_2, str(tmp_path / "probe"), mode)[0]
    assert probe["stopped"] is None and probe["found"]["step-2"][0] == ".checksums", probe
    saved = tmp_path / "probe" / "checkpoint" / "step-2"
    page = os.sysconf("SC_PAGE_SIZE")
    pages = sum(-(-f.stat().st_size // page) for f in saved.iterdir() if f.name != ".checksums")
    # ("probe" and "small" are as long: the .metadata records the folder's path)
    with tmpfs(tmp_path / "small", pages * page) as disk:
        results = run_ranks(2, _save_step_2, str(disk), mode)
    for result in results:
        assert result["found"] == {}, result  # the partial step-2.tmp removed
        assert result["stopped"] == (
            f"[checkpoint] out of disk space saving step-2 in {disk / 'checkpoint'}: the disk "
            f"or a quota filled up ({pages * page} bytes were free when it began); the partial "
            "step-2.tmp was removed and the checkpoints there stay as they were (none); free "
            "space or point [checkpoint] folder at a larger disk, then run the same command to "
            "resume"
        ), result


def _lean_job(folder: Path, seed: int) -> tuple[list, object, TrainState, CheckpointManager]:
    """A mixed-precision job whose masters are kept as remainders, with bf16 moments."""
    from containers import (
        LeanAdamW,
        MasterWeights,
        MixedPrecisionOptimizersContainer,
        MixedPrecisionSettings,
    )

    precision = MasterWeights(
        MixedPrecisionSettings(loss_scaling="none", store_param_remainders=True)
    )
    parts = [precision.cast_model(p) for p in three_parts(seed)]
    kwargs = {"lr": 1e-2, "moment_dtype": "bfloat16"}
    optimizers = MixedPrecisionOptimizersContainer(parts, LeanAdamW, kwargs, precision=precision)
    state = TrainState()
    states = {"model": ModelWrapper(parts), "optimizer": optimizers, "train_state": state}
    manager = CheckpointManager(Checkpoint(enable=True, interval=2), str(folder), states, 4)
    return parts, optimizers, state, manager


def test_a_resume_never_makes_masters_kept_as_remainders_fp32(tmp_path):
    """Neither the key check nor the load takes fp32 templates of them (`load_planner`)."""
    parts, optimizers, state, manager = _lean_job(tmp_path, 0)
    for step in range(1, 3):
        optimizers.zero_grad()
        x = torch.randn(6, 10, generator=torch.Generator().manual_seed(step)).bfloat16()
        optimizers.backward(forward(parts, x).float().square().mean())
        optimizers.step()
        state.step = step
        manager.maybe_save(step)
    manager.close()
    expected = _snapshot(parts, optimizers)
    parts2, optimizers2, _, manager2 = _lean_job(tmp_path, 1)
    made = []
    flats = {id(f): f for f, _ in optimizers2.precision.flat_of.values()}.values()
    for flat in flats:
        flat.master_value = lambda i: made.append(i)  # type: ignore[method-assign]
    assert manager2.load() == 2 and not made
    for flat in flats:
        del flat.master_value
    assert_same(_snapshot(parts2, optimizers2), expected)


def _adamw_job(folder: Path, moments: str) -> tuple[list, OptimizersContainer, CheckpointManager]:
    """LeanAdamW over `three_parts`, its moments kept as `moments`, saved at step 2."""
    from containers import LeanAdamW

    parts = three_parts(0)
    optimizers = OptimizersContainer(parts, LeanAdamW, {"lr": 1e-2, "moment_dtype": moments})
    state = TrainState()
    state.step = 2
    states = {"model": ModelWrapper(parts), "optimizer": optimizers, "train_state": state}
    return parts, optimizers, CheckpointManager(Checkpoint(enable=True), str(folder), states, 2)


def test_bf16_moments_into_8bit_codes_are_read_as_bf16_and_said_once(tmp_path, caplog):
    """The templates of moments a load codes take the checkpoint's dtype: bf16 is read as
    bf16 (no fp32 copy of the state), so the line says the coding and no widening."""
    from containers.update.forms import MOMENT_CODECS

    parts, optimizers, manager = _adamw_job(tmp_path, "bfloat16")
    train(parts, optimizers, 2)
    manager.maybe_save(2)
    manager.close()
    saved = optimizers.state_dict()
    parts2, optimizers2, manager2 = _adamw_job(tmp_path, "8bit")
    with caplog.at_level("INFO"):
        assert manager2.load() == 2
    said = [m for r in caplog.records if "converted on load: " in (m := r.getMessage())]
    assert len(said) == 1, said
    assert said[0].split("converted on load: ")[1] == (
        "exp_avg, exp_avg_sq tensor -> 8-bit codes (6 tensors)"
    )
    loaded = optimizers2.state_dict()
    matrices = {k: v for part in parts2 for k, v in part.named_parameters() if v.dim() == 2}
    assert len(matrices) == 3
    for fqn, p in matrices.items():
        for name in ("exp_avg", "exp_avg_sq"):
            value = saved[f"state.{fqn}.{name}"]
            assert value.dtype == torch.bfloat16
            want = MOMENT_CODECS["8bit"].from_values(name, value, p)
            for k in ("code", "scale"):
                assert torch.equal(loaded[f"state.{fqn}.{name}.{k}"], want[k]), (fqn, name, k)


# -- inf or NaN in a checkpoint (issue 47, 2) -----------------------------------------------


@pytest.mark.parametrize("word", ["model.mid.weight", "exp_avg_sq"])
def test_a_checkpoint_holding_nan_is_refused_before_anything_changes(tmp_path, word):
    parts, optimizers, state, manager = _job(tmp_path, interval=2)
    _train_and_save(manager, parts, optimizers, state, range(1, 7))
    folder = tmp_path / "checkpoint"
    key = poison(folder / "step-6", word)
    poison(folder / "step-4", "exp_avg")  # the newest finite one is step-2
    before = _tree_bytes(folder)
    parts2, optimizers2, state2, manager2 = _job(tmp_path, seed=9, interval=2)
    fresh = _snapshot(parts2, optimizers2)
    fix = r"load_step = 2 and set_aside_newer = true \(moves the newer steps aside\)$"
    with pytest.raises(ConfigError, match=rf"step-6 holds inf or NaN \(first in {key}\).*{fix}"):
        manager2.load()
    assert _tree_bytes(folder) == before
    assert_same(_snapshot(parts2, optimizers2), fresh) and state2.step == 0
    # The step it names loads.
    manager3 = _job(tmp_path, interval=2, load_step=2, set_aside_newer=True)[3]
    assert manager3.load() == 2


def test_with_no_finite_checkpoint_the_line_says_the_run_would_start_over(tmp_path):
    parts, optimizers, state, manager = _job(tmp_path, interval=2)
    _train_and_save(manager, parts, optimizers, state, range(1, 3))
    poison(tmp_path / "checkpoint" / "step-2", "exp_avg")
    with pytest.raises(ConfigError, match=r"\(no finite checkpoint there: the run would start"):
        _job(tmp_path, interval=2)[3].load()


def _poisoned_on_two_ranks(folder: str) -> str:
    """Saved by 2 ranks, NaN put in the last tensor (in the bytes rank 1 reads), loaded again."""
    parts, optimizers, state, manager = _job(Path(folder), interval=2)
    _train_and_save(manager, parts, optimizers, state, range(1, 3))
    if dist.get_rank() == 0:
        poison(Path(folder) / "checkpoint" / "step-2", "optimizer.state.", last=True)
    dist.barrier()
    try:
        _job(Path(folder), seed=3, interval=2)[3].load()
    except ConfigError as e:
        return str(e)
    return "loaded"


def test_the_ranks_agree_on_a_nan_that_one_of_them_read(tmp_path):
    said = run_ranks(2, _poisoned_on_two_ranks, str(tmp_path))
    assert said[0] == said[1] and "holds inf or NaN (first in optimizer.state." in said[0]


def test_a_seed_holding_nan_is_refused_before_anything_changes(tmp_path):
    """A torchtitan model-only checkpoint (weights at the top level) with a NaN weight."""
    import torch.distributed.checkpoint as dcp

    weights = {k: v.clone() for part in three_parts(1) for k, v in part.state_dict().items()}
    weights["head.weight"][2, 3] = float("nan")
    seed = tmp_path / "torchtitan" / "step-5"
    dcp.save(weights, checkpoint_id=seed, no_dist=True)
    before = _tree_bytes(seed)
    parts, optimizers, state, manager = _job(
        tmp_path / "run", seed=9, initial_load_path=str(seed), initial_load_model_only=True
    )
    fresh = _snapshot(parts, optimizers)
    said = rf"initial_load_path = '{seed}' holds inf or NaN \(first in head.weight\); nothing"
    with pytest.raises(ConfigError, match=said):
        manager.load()
    assert_same(_snapshot(parts, optimizers), fresh) and state.step == 0
    assert _tree_bytes(seed) == before


def test_the_kept_checkpoints_are_called_finite_only_where_this_run_checked_them(tmp_path):
    parts, optimizers, state, manager = _job(tmp_path, interval=2)
    _train_and_save(manager, parts, optimizers, state, range(1, 5))
    assert manager.finite_kept() == "all finite"  # it saved each
    parts2, optimizers2, state2, manager2 = _job(tmp_path, interval=2)
    assert manager2.load() == 4
    assert manager2.finite_kept() == "step-4 checked finite by this run"  # not step-2
    _train_and_save(manager2, parts2, optimizers2, state2, range(5, 7))
    assert manager2.finite_kept() == "step-4, step-6 checked finite by this run"


def test_a_last_save_refused_for_nan_is_remembered_until_a_save_passes(tmp_path):
    parts, optimizers, state, manager = _job(tmp_path, interval=1)
    _train_and_save(manager, parts, optimizers, state, range(1, 2))
    assert not manager.last_save_refused
    with torch.no_grad():
        parts[1].mid.weight[0, 0] = float("nan")
    state.step = 2
    manager.maybe_save(2)
    assert manager.last_save_refused and sorted(complete_checkpoints(tmp_path / "checkpoint")) == [
        1
    ]


# -- what sits under a checkpoint's name (issue 47, 3) --------------------------------------


def _entries(folder: Path) -> dict[str, object]:
    """Each entry of `folder` but the lock: a link's target, a folder's files, a file's bytes."""
    return {
        p.name: os.readlink(p)
        if p.is_symlink()
        else _tree_bytes(p)
        if p.is_dir()
        else p.read_bytes()
        for p in folder.iterdir()
        if p.name != "run.lock"
    }


def _file(folder: Path, name: str) -> None:
    (folder / name).write_text("the user's notes")


STRANGERS = {
    "a file step-6": (lambda f: _file(f, "step-6"), "step-6 (a file)"),
    "a file step-4.tmp": (lambda f: _file(f, "step-4.tmp"), "step-4.tmp (a file)"),
    "a file step-6.old": (lambda f: _file(f, "step-6.old"), "step-6.old (a file)"),
    "a link step-6": (lambda f: (f / "step-6").symlink_to(f / "step-2"), "step-6 (a link)"),
    "an older folder without .metadata": (
        lambda f: (f / "step-1").mkdir(),
        "step-1 (a folder without .metadata)",
    ),
}


@pytest.mark.parametrize("case", STRANGERS)
def test_what_is_no_checkpoint_under_a_checkpoint_name_stops_the_run_and_stays(
    tmp_path, case, caplog
):
    parts, optimizers, state, manager = _job(tmp_path, interval=2)
    _train_and_save(manager, parts, optimizers, state, range(1, 3))
    folder = tmp_path / "checkpoint"
    put, named = STRANGERS[case]
    put(folder)
    before = _entries(folder)
    parts2, optimizers2, state2, manager2 = _job(tmp_path, seed=9, interval=2)
    fresh = _snapshot(parts2, optimizers2)
    lock = RunLock(folder)  # as build_job takes it: a stale step-N.tmp would be removed
    lock.acquire()
    try:
        with caplog.at_level("WARNING"), pytest.raises(ConfigError) as refused:
            manager2.load()
    finally:
        lock.release()
    assert f"{folder / named}: not a checkpoint" in str(refused.value)
    assert "removed" not in caplog.text
    assert _entries(folder) == before
    assert_same(_snapshot(parts2, optimizers2), fresh) and state2.step == 0


def _step_folders_appear(folder: str, mode: str) -> dict:
    """A run saves step-2; the next resumes it, keeping the latest 1, and trains steps 3-7,
    saved every 2 and at 7, with the user's `step-1` and `step-4` folders made once it
    loaded (no load saw them)."""
    parts, optimizers, state, manager = _job(Path(folder), interval=2, async_mode=mode)
    _run_to_the_end(manager, parts, optimizers, state, range(1, 3))
    lines = _manager_lines()
    parts, optimizers, state, manager = _job(
        Path(folder), interval=2, async_mode=mode, keep_latest_k=1
    )
    assert manager.load() == 2
    if dist.get_rank() == 0:
        for name in ("step-1", "step-4"):
            stranger = Path(folder) / "checkpoint" / name
            stranger.mkdir()
            _file(stranger, "notes")
    dist.barrier()
    stopped = _run_to_the_end(manager, parts, optimizers, state, range(3, 8))
    return {"lines": lines, "stopped": stopped, "step": state.step, "kept": manager.kept()}


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_step_folders_that_appear_during_the_run_are_never_replaced_or_rotated(tmp_path, mode):
    """Rank 0 finds `step-4` when it publishes (async: in DCP's thread): one line, true of
    step-4.tmp, and every rank trains on and saves; rotation removes the checkpoints the run
    found or saved (the previous run's step-2 among them), never the user's folders."""
    ours, other = run_ranks(2, _step_folders_appear, str(tmp_path), mode)
    folder = tmp_path / "checkpoint"
    errors = [line for line in ours["lines"] if line.startswith("ERROR")]
    assert errors == [
        f"ERROR [checkpoint] {folder / 'step-4'} appeared during this run and is none of its "
        "checkpoints: left as it is, so step 4 was not saved; its files stay in step-4.tmp, "
        f"which the next start removes (to keep them, move step-4 out of {folder} and rename "
        "step-4.tmp to step-4); training goes on (the next save may succeed)"
    ], ours["lines"]
    assert not [line for line in other["lines"] if line.startswith("ERROR")]
    assert ours["stopped"] is other["stopped"] is None
    assert ours["step"] == other["step"] == 7
    assert ours["kept"] == other["kept"] == "step-7"
    assert sorted(_entries(folder)) == ["step-1", "step-4", "step-4.tmp", "step-7"]
    assert (
        _entries(folder / "step-1") == _entries(folder / "step-4") == {"notes": b"the user's notes"}
    )
    # What the line says keeps the save: it loads, its checksums verified.
    (folder / "step-4").rename(tmp_path / "the user's step-4")
    (folder / "step-4.tmp").rename(folder / "step-4")
    _, _, state, manager = _job(tmp_path, load_step=4)
    assert manager.load(read_only=True) == 4 and state.step == 4


def _a_rename_fails_at_step_4(folder: str, mode: str) -> dict:
    """Steps 1-7 of `_job`, saved every 2 and at 7, where renaming `step-4.tmp` to `step-4`
    fails on rank 0 (an I/O error the disk gives, injected into `os.replace`)."""
    import errno

    rename = os.replace

    def failing(src: object, dst: object) -> None:
        if Path(str(dst)).name == "step-4":
            raise OSError(errno.EIO, "Input/output error", str(dst))
        rename(src, dst)

    if dist.get_rank() == 0:
        os.replace = failing  # (this rank process only)
    lines = _manager_lines()
    parts, optimizers, state, manager = _job(Path(folder), interval=2, async_mode=mode)
    stopped = _run_to_the_end(manager, parts, optimizers, state, range(1, 8))
    return {"lines": lines, "stopped": stopped, "step": state.step}


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_rename_that_fails_on_rank_0_is_one_line_and_every_rank_trains_on(tmp_path, mode):
    """The publishing rename is rank 0's alone: its failure is agreed like a failed save
    (no rank waits for the others), said in one line, and the save's files stay in
    step-4.tmp as the line says; the later saves are made."""
    ours, other = run_ranks(2, _a_rename_fails_at_step_4, str(tmp_path), mode)
    folder = tmp_path / "checkpoint"
    errors = [line for line in ours["lines"] if line.startswith("ERROR")]
    assert errors == [
        "ERROR [checkpoint] step-4 not saved: step-4.tmp could not be renamed step-4 (OSError: "
        f"[Errno 5] Input/output error: '{folder / 'step-4'}'), its files stay there; the "
        f"checkpoints in {folder} stay as they were (step-2); training goes on (the next save "
        "may succeed)"
    ], ours["lines"]
    assert not [line for line in other["lines"] if line.startswith("ERROR")]
    assert ours["stopped"] is None and other["stopped"] is None
    assert ours["step"] == other["step"] == 7
    assert sorted(_entries(folder)) == ["step-2", "step-4.tmp", "step-6", "step-7"]
    assert (folder / "step-4.tmp" / ".metadata").is_file()
