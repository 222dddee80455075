"""DCP checkpoints of a training job: atomic, resumable, reshardable across world sizes.

A checkpoint is written to `step-N.tmp` and renamed to `step-N` once DCP has finished (its
`.metadata` is written last), so a process killed during a save never leaves a directory that
resume would take; the previous checkpoint stays the newest complete one. An async save writes
in the background from a CPU copy taken before training goes on
(`components.checkpoint.staging`). A `step-N` damaged afterwards (files removed, truncated or
overwritten) is reported when it would be loaded, never skipped for an older one
(`components.checkpoint.files`), as is one holding inf or NaN (`components.checkpoint.finite`).
A save holding a non-finite value is refused, and one that fails is one line: out of disk, or
the run's last save, ends the run; otherwise training goes on (`components.checkpoint.save`).
Only the run holding the folder's lock (`components.run_lock`) removes what a stopped save
left; a file, a link or a folder without `.metadata` under a name a save writes stops the run
before step 1, and one that appears there later is never replaced.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from components.checkpoint.files import (
    Damaged,
    changed_model_settings,
    check_matches,
    checkpoint_steps,
    clear_stale,
    damaged_checkpoint_error,
    describe,
    forgetting_on_failure,
    load_refusal,
    model_settings_file,
    refuse_strangers,
    verified,
    verify,
    write_checksums,
)
from components.checkpoint.finite import first_nonfinite, nonfinite_checkpoint_error
from components.checkpoint.resume import ConfigSettings
from components.checkpoint.save import (
    SaveFailed,
    any_rank,
    audit,
    first_failure,
    folder_bytes,
    save_failed,
)
from components.checkpoint.seed import load_seed, open_seed
from components.checkpoint.staging import Staged, Stager
from components.run_lock import holds
from config import Checkpoint as CheckpointConfig
from config import ConfigError
from containers import OptimizersContainer, load_planner

__all__ = ["CheckpointManager", "ModelWrapper", "TrainState", "complete_checkpoints"]

logger = logging.getLogger(__name__)


class ModelWrapper(Stateful):
    """The model parts as one flat FQN-keyed state dict (DTensors stay sharded)."""

    def __init__(self, model_parts: list[nn.Module]) -> None:
        self.model_parts = model_parts

    def state_dict(self) -> dict[str, Any]:
        return {k: v for part in self.model_parts for k, v in get_model_state_dict(part).items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.model_parts:
            own = {k: state_dict[k] for k in get_model_state_dict(part)}
            set_model_state_dict(part, own, options=StateDictOptions(strict=True))


class TrainState(Stateful):
    """The step counter (batches spent, skipped steps included), the steps skipped for
    non-finite numbers, and the CPU RNG state."""

    def __init__(self) -> None:
        self.step = 0
        self.skipped_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.skipped_steps = int(state_dict["skipped_steps"])
        torch.set_rng_state(state_dict["rng"])


def complete_checkpoints(folder: Path) -> dict[int, Path]:
    """Checkpoints under `folder` that finished saving (`step-N`, not `step-N.tmp`), by step.

    Intact or not: `CheckpointManager.load` verifies the one it loads and reports it if damaged.
    """
    return checkpoint_steps(folder)


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class _AsyncSave:
    """An async save in flight and whether its `step-N` is published yet."""

    future: Future
    step: int
    needed: int
    free: int
    rotate: bool = True
    last: bool = False
    """No later save follows (the run's last step, or a forced one): a failure stops the run."""
    published: bool = False
    error: BaseException | None = None


class CheckpointManager:
    """Saves every `interval` steps and at the end; resumes from the newest complete checkpoint.

    Args:
        cfg: the `[checkpoint]` section.
        dump_folder: `[job] dump_folder`; checkpoints go to `dump_folder/cfg.folder`.
        states: the Stateful objects to save, by name (model, optimizer, lr_scheduler, ...).
        total_steps: the last step, which is always saved.
        model_settings: the model's family, flavor and arguments, recorded with each save
            and compared on resume (None: neither).
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        dump_folder: str,
        states: dict[str, Stateful],
        total_steps: int,
        model_settings: dict[str, Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.model_settings = model_settings
        self.folder = Path(dump_folder) / cfg.folder
        self.states = states
        self.total_steps = total_steps
        self._pending: _AsyncSave | None = None
        self._deferred = False  # a save fell due inside a skip streak: make it at the next step
        self._ours: set[int] = set()
        """The steps this run loaded or saved: each checked finite, and its own to save again."""
        self._found: set[int] = set()
        """The checkpoints in the folder when the run started, up to the one it resumed (the
        load checked each name; newer ones are refused or set aside). A run that never loads
        rotates only its own saves."""
        self.last_save_refused = False
        """The last save was refused (inf or NaN, said in its line): the run must not exit 0."""
        # Guards publishing between DCP's save thread (done-callback) and the training thread.
        self._publish_lock = threading.Lock()
        # This run's hyperparameters, put back after it resumes a checkpoint or a seed.
        optimizer = states.get("optimizer")
        ours = isinstance(optimizer, OptimizersContainer)
        self._config = ConfigSettings(optimizer) if ours else None
        self._async = cfg.enable and cfg.async_mode != "disabled"
        keep = cfg.async_mode == "async_with_pinned_mem"
        self._stager = Stager(keep=keep, pin=keep and torch.cuda.is_available())
        # Async saves run collectives from a background thread: give them a group of their
        # own so they never interleave with the training's collectives.
        self._pg = dist.new_group(backend="gloo") if self._async and dist.is_initialized() else None

    # -- resume --------------------------------------------------------------------------

    def load(self, read_only: bool = False) -> int:
        """Load the checkpoint that `load_step` picks (newest by default); return its step.
        With none in the folder, `initial_load_path` seeds the run (`components.checkpoint.seed`).

        A run that trains on from a step older than the newest would overwrite and rotate
        away the newer checkpoints: refused (or, with `set_aside_newer`, they are moved
        aside first). `read_only` loads to inspect, so it never refuses or moves anything.
        """
        if not self.cfg.enable:
            return 0
        if not read_only:
            self._prepare_folder()
        found = complete_checkpoints(self.folder)
        if self.cfg.load_step >= 0 and self.cfg.load_step not in found:
            raise ConfigError(
                f"[checkpoint] load_step = {self.cfg.load_step}: no complete checkpoint "
                f"step-{self.cfg.load_step} in {self.folder}; available: "
                f"{sorted(found) or 'none'} (use -1 for the newest)"
            )
        step = self.cfg.load_step if self.cfg.load_step >= 0 else max(found, default=-1)
        if not read_only:
            refuse_strangers(self.folder, found, step)
            self._found = {s for s in found if s <= step}
        if step < 0 and self.cfg.initial_load_path:
            model_only = self.cfg.initial_load_model_only
            seed = open_seed(self.cfg.initial_load_path, model_only)
            self._refuse_model_changes(seed.path, seed=True)  # (read by verify already)
            step = load_seed(seed, self.states, model_only)
            self._config_wins()
            return step
        if step < 0:
            logger.info("no checkpoint in %s: starting from scratch", self.folder)
            return 0
        path = found[step]
        try:
            metadata = verify(path, shared=True)
        except Damaged as damage:
            raise damaged_checkpoint_error(step, damage, found) from None
        if not verified(path):
            logger.info(
                "%s records no checksums (saved before they were recorded): loading it "
                "unverified, sizes and values checked only",
                path,
            )
        # One planner for the check and the load: the state dicts both take are its templates
        # (masters kept as remainders are not made fp32 for either).
        with load_planner(self.states) as planner, forgetting_on_failure(self.states):
            check_matches(self.states, path, metadata)
            try:
                self._refuse_model_changes(path)  # (one that keeps every shape: top_k 2 -> 1)
            except Damaged as damage:
                raise damaged_checkpoint_error(step, damage, found) from None
            try:
                key = first_nonfinite(path, metadata)
            except Damaged as damage:
                raise damaged_checkpoint_error(step, damage, found) from None
            if key is not None:
                raise nonfinite_checkpoint_error(step, key, found)
            newer = [s for s in found if s > step]
            if newer and not read_only:
                self._protect_newer(step, newer)
            try:
                dcp.load(self.states, checkpoint_id=path, planner=planner)
            except ValueError as e:  # a part of the job refused the checkpoint's values
                raise load_refusal(path, e) from None
        self._ours.add(step)
        self._config_wins()
        seed = self.cfg.initial_load_path
        # As in torchtitan: the run's own checkpoint wins, so a restart keeps its arguments.
        logger.info(
            "resumed from %s%s", path, f" (not from initial_load_path {seed})" if seed else ""
        )
        return step

    def _refuse_model_changes(self, path: Path, seed: bool = False) -> None:
        """A checkpoint (or `seed`) of a model with other settings is refused (nothing loaded)
        unless `[checkpoint] allow_model_changes`; it is said either way."""
        if self.model_settings is None:
            return
        changed = changed_model_settings(path, self.model_settings)
        if not changed:
            return
        if not self.cfg.allow_model_changes:
            where = f"initial_load_path = '{path}'" if seed else str(path)
            raise ConfigError(
                f"[checkpoint] {where} holds a model with other settings "
                f"({'; '.join(changed)}); nothing was loaded: {'run' if seed else 'resume'} "
                "with the checkpoint's [model] settings, or set [checkpoint] "
                "allow_model_changes = true if the change is meant"
            )
        logger.warning(
            "%s holds a model with other settings (%s): loading it, as [checkpoint] "
            "allow_model_changes = true allows",
            path,
            "; ".join(changed),
        )

    def _config_wins(self) -> None:
        """Put this run's hyperparameters back over the loaded ones (the LR schedulers, which
        load after the optimizer, have set the lrs from this run's base lrs already)."""
        if self._config is not None:
            self._config.restore()

    def _prepare_folder(self) -> None:
        """Before step 1: the folder must be writable (not found out at the first save), and
        `step-N.tmp` left by a run killed mid-save is removed, but only under this run's lock
        on the folder: without it, another live run may be writing it."""
        probe = self.folder / f".write-probe-{os.getpid()}"
        try:  # on every rank, so all of them stop together
            self.folder.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ConfigError(
                f"[checkpoint] folder: {self.folder} is not writable ({e.strerror}); point "
                "[job] dump_folder at a writable place or set [checkpoint] enable = false"
            ) from None
        if _rank0():
            clear_stale(self.folder, owned=holds(self.folder))
        _barrier()

    def _protect_newer(self, step: int, newer: list[int]) -> None:
        """Refuse to train on from `step` over `newer` checkpoints, or move them aside."""
        names = ", ".join(f"step-{s}" for s in newer)
        if not self.cfg.set_aside_newer:
            raise ConfigError(
                f"[checkpoint] load_step = {step}: {self.folder} also holds {names}, which a "
                "run from an older step would overwrite or rotate away; resume the newest "
                f"(load_step = -1), copy step-{step} into another [job] dump_folder, or set "
                "[checkpoint] set_aside_newer = true to move them aside"
            )
        aside = self.folder / f"aside-{time.strftime('%Y%m%d-%H%M%S')}-from-step-{step}"
        if _rank0():
            aside.mkdir()
            for s in newer:
                os.replace(self.folder / f"step-{s}", aside / f"step-{s}")
            _fsync_dir(self.folder)
            logger.warning("moved %s aside to %s; training on from step-%d", names, aside, step)
        _barrier()

    # -- save ----------------------------------------------------------------------------

    def maybe_save(self, step: int, force: bool = False, skipped: bool = False) -> None:
        """Save at multiples of `interval`, at the last step and when `force`d; finish earlier
        async saves.

        `skipped`: the step changed no weight (a skip streak): a save due now waits for the
        next applied step, so the streak rotates no good checkpoint away; a forced or last
        save is made but rotates nothing.
        """
        if not self.cfg.enable:
            return
        due = step % self.cfg.interval == 0 or self._deferred
        if skipped and not force and step != self.total_steps:
            self._deferred = due
            return
        if not (due or force or step == self.total_steps):
            return
        self._deferred = False
        self._finish_pending()
        last = force or step == self.total_steps
        # Taken once: what the audit checks is what the save writes.
        state_dicts = {name: state.state_dict() for name, state in self.states.items()}
        checked = audit(state_dicts)
        self.last_save_refused = checked.nonfinite > 0
        if self.last_save_refused:
            if _rank0():
                logger.error("%s", checked.refusal(step, self.folder, self.kept()))
            return
        tmp = self.folder / f"step-{step}.tmp"
        if _rank0():
            shutil.rmtree(tmp, ignore_errors=True)  # left by a process killed mid-save
            self.folder.mkdir(parents=True, exist_ok=True)
        _barrier()
        # A step saved before has the same layout: its size is what this one needs.
        found = self._checkpoints()
        needed = folder_bytes(found[max(found)]) if found else checked.nbytes
        free = shutil.disk_usage(self.folder).free
        if self._async:
            save = _AsyncSave(Future(), step, needed, free, rotate=not skipped, last=last)
            self._save_async(state_dicts, save)
            return
        try:
            dcp.save(state_dicts, checkpoint_id=tmp)
            self._seal(tmp, shared=True)  # raised on every rank, as DCP's failures are
        except (Exception, CheckpointException) as e:
            self._failed(save_failed(self.folder, step, e, needed, free, self.kept()), last)
            return
        refused = None
        try:
            self._publish(step, rotate=not skipped)
        except SaveFailed as e:  # (rank 0's alone: every rank hears it)
            refused = e
        refused = first_failure(refused)  # (a collective: it also waits for the rename)
        if refused is not None:
            self._failed(refused, last)
        else:
            self._ours = self._ours | {step}  # (rank 0's since it published)

    def _seal(self, tmp: Path, shared: bool) -> None:
        """Record the model's settings and every file's checksum in the saved `tmp` (`shared`:
        every rank at once, each hashing the files it wrote; else rank 0 alone)."""
        also = None if self.model_settings is None else model_settings_file(self.model_settings)
        write_checksums(tmp, shared=shared and dist.is_initialized(), also=also)

    def _save_async(self, state_dicts: dict[str, Any], save: _AsyncSave) -> None:
        """Copy `state_dicts` to CPU (every rank, or none, goes on) and write the copy in
        the background: `save` takes DCP's future and is published from DCP's thread once
        written."""
        try:
            staged, error = self._stager.stage(state_dicts), None
        except Exception as e:  # e.g. out of CPU memory: nothing written, nothing launched
            staged, error = None, e
        if any_rank(error is not None):  # a rank that writes alone would wait for the others
            if error is None:
                error = RuntimeError("the CPU copy failed on another rank")
            line = f"[checkpoint] step-{save.step} not saved: its CPU copy for the async save "
            line += f"failed ({describe(error)}); the checkpoints in {self.folder} stay as "
            self._failed(SaveFailed(f"{line}they were ({self.kept()})", stops=False), save.last)
            return
        save.future = dcp.async_save(
            staged,
            checkpoint_id=self.folder / f"step-{save.step}.tmp",
            process_group=self._pg,
            async_stager=Staged(),
            no_dist=not dist.is_initialized(),
        )
        self._pending = save
        save.future.add_done_callback(lambda _: self._publish_when_saved(save))

    def _failed(self, failure: SaveFailed, last: bool) -> None:
        """A failed save: stop the run (out of disk, or no later save follows), naming what
        resumes; else say it in one line and train on (a later save may succeed)."""
        if failure.stops:
            raise failure
        if last:
            newest = max(self._checkpoints(), default=None)
            then = (
                f"the same command resumes from step-{newest}"
                if newest is not None
                else "nothing is saved: the same command starts over"
            )
            raise SaveFailed(f"{failure}; the run stops: {then}")
        if _rank0():
            logger.error("%s; training goes on (the next save may succeed)", failure)

    def newest(self) -> str:
        """The newest complete checkpoint, in words (from any thread: a folder listing)."""
        if not self.cfg.enable:
            return "checkpoint.enable = false: nothing saved"
        found = self._checkpoints()
        if not found:
            return f"no checkpoint in {self.folder}: nothing saved"
        return f"the newest checkpoint is {found[max(found)]}; later steps are not saved"

    def kept(self) -> str:
        """The run's checkpoints, for a message: `step-20, step-30` or `none`."""
        return ", ".join(f"step-{s}" for s in self._checkpoints()) or "none"

    def _checkpoints(self) -> dict[int, Path]:
        """The folder's checkpoints that are the run's, by step: those it found when it
        started or saved since. A `step-N` put there meanwhile is none of them: never
        rotated away, listed or named to resume from."""
        ours = self._found | self._ours
        return {s: p for s, p in complete_checkpoints(self.folder).items() if s in ours}

    def finite_kept(self) -> str:
        """What a message may say of the kept checkpoints' numbers: `all finite` where this run
        checked each (loading or saving it), else which ones it checked."""
        kept = self._checkpoints()
        checked = [f"step-{s}" for s in kept if s in self._ours]
        if len(checked) == len(kept):
            return "all finite"
        return f"{', '.join(checked) or 'none'} checked finite by this run"

    def _publish_when_saved(self, save: _AsyncSave) -> None:
        """In DCP's save thread, as soon as the save is complete: rename it to `step-N` then,
        not at a later step, so a kill in between keeps the checkpoint."""
        try:
            failure = save.future.exception()
            if failure is None:
                self._publish_once(save)
            else:  # said by _finish_pending; the partial save goes now, on every rank
                save_failed(self.folder, save.step, failure, save.needed, save.free, self.kept())
        except BaseException as e:  # the future would only log it: hand it to the trainer
            save.error = e

    def _publish_once(self, save: _AsyncSave) -> None:
        """Publish `save` (from DCP's thread or the trainer's, whichever comes first); raise
        what failed in either."""
        with self._publish_lock:
            if not save.published:
                save.published = True
                try:
                    if _rank0():  # (rank 0 hashes every file: the others train on)
                        self._seal(self.folder / f"step-{save.step}.tmp", shared=False)
                    self._publish(save.step, save.rotate)
                except BaseException as e:
                    save.error = e
            if save.error is not None:
                raise save.error

    def _finish_pending(self, closing: bool = False) -> None:
        """Wait for the async save in flight; if it or its publishing failed on any rank, say
        so on every rank (`_failed`: the run stops where it was the last save, or when
        `closing`). Every rank calls it at the same points: it is a collective."""
        if self._pending is None:
            return
        save, self._pending = self._pending, None
        failure = None
        try:
            save.future.result()
            self._publish_once(save)
        except SaveFailed as e:  # not published: the save stays as the line says
            failure = e
        except (Exception, CheckpointException) as e:
            failure = save_failed(self.folder, save.step, e, save.needed, save.free, self.kept())
        failure = first_failure(failure)
        if failure is not None:
            self._failed(failure, save.last or closing)
        else:
            self._ours = self._ours | {save.step}  # (rank 0's since it published)

    def _publish(self, step: int, rotate: bool = True) -> None:
        """Make `step-N.tmp` the complete `step-N` (rank 0) and drop old checkpoints (if
        `rotate`). What rank 0 cannot do is a `SaveFailed` there alone: the caller agrees
        on it."""
        ours = step in self._ours
        if not _rank0():
            return
        tmp, final = self.folder / f"step-{step}.tmp", self.folder / f"step-{step}"
        if (final.exists() or final.is_symlink()) and not ours:  # put there while we trained
            raise SaveFailed(
                f"[checkpoint] {final} appeared during this run and is none of its "
                f"checkpoints: left as it is, so step {step} was not saved; its files stay in "
                f"{tmp.name}, which the next start removes (to keep them, move {final.name} "
                f"out of {self.folder} and rename {tmp.name} to {final.name})",
                stops=False,
            )
        try:
            if final.exists() or final.is_symlink():
                # Saving again a step this run saved or loaded (a stop right after it).
                old = self.folder / f"step-{step}.old"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                try:
                    os.replace(tmp, final)
                except OSError:
                    os.replace(old, final)  # the step as it was
                    raise
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
        except OSError as e:
            raise SaveFailed(
                f"[checkpoint] step-{step} not saved: {tmp.name} could not be renamed "
                f"{final.name} ({describe(e)}), its files stay there; the checkpoints in "
                f"{self.folder} stay as they were ({self.kept()})",
                stops=False,
            ) from e
        self._ours = self._ours | {step}
        try:
            _fsync_dir(self.folder)
        except OSError as e:
            logger.warning("%s saved, but its folder not synced (%s)", final, describe(e))
        logger.info("saved checkpoint %s", final)
        if rotate and self.cfg.keep_latest_k > 0:
            for stale in list(self._checkpoints())[: -self.cfg.keep_latest_k]:
                shutil.rmtree(self.folder / f"step-{stale}", ignore_errors=True)
                self._ours, self._found = self._ours - {stale}, self._found - {stale}

    def export_model(self, model_parts: list[nn.Module], step: int) -> Path | None:
        """Write the full (unsharded) model state dict to one file for inference."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = {
            k: v
            for part in model_parts
            for k, v in get_model_state_dict(part, options=options).items()
        }
        if not _rank0():
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"model-step-{step}.pt"
        tmp = path.with_suffix(".pt.tmp")
        torch.save(full, tmp)
        os.replace(tmp, path)
        logger.info("exported model to %s", path)
        return path

    def close(self) -> None:
        """Wait for an async save in flight and publish it; free the kept CPU copies."""
        self._finish_pending(closing=True)
        self._stager.close()
        _barrier()
