"""Seeding a run from another checkpoint folder (`[checkpoint] initial_load_path`), ours or
torchtitan's, and the key mapping between the two layouts (shared with `scripts.convert`).

torchtitan 0.3.0 writes the same DCP folder as ours but for four things: model weights at the
top level (ours under `model.`), its LR schedule as `lr_scheduler.last_epoch` (ours `.step`),
`train_state` holding `step` and `ntokens_seen`, and per-rank pickled `dataloader.dp_rank_<r>`
blobs; keys of `torch.compile`d submodules may keep `_orig_mod.`. Its `optimizer` entry is our
flat format key for key. A seed is loaded through DCP into this job's own state dicts, so it
reshards as our checkpoints do; what has no counterpart here is named and skipped.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from components.checkpoint.files import (
    Damaged,
    agree_across_ranks,
    checkpoint_steps,
    dtype_changes,
    forgetting_on_failure,
    saved_dtype,
    unreadable,
    verify,
)
from components.checkpoint.finite import first_nonfinite
from config import ConfigError
from containers import OptimizersContainer
from containers.state.flat import describe_keys

__all__ = ["Layout", "Seed", "from_torchtitan", "load_seed", "open_seed", "to_torchtitan"]

logger = logging.getLogger(__name__)

Layout = Literal["ours", "torchtitan"]

# torchtitan's entries beside the top-level model weights (its MODEL entry is flattened away).
SECTIONS = ("optimizer", "lr_scheduler", "train_state", "dataloader")
_RENAMED = {"lr_scheduler.step": "lr_scheduler.last_epoch"}
_RENAMED_BACK = {v: k for k, v in _RENAMED.items()}
_COMPILED = re.compile(r"(^|\.)_orig_mod\.")
_KEY = "[checkpoint] initial_load_path"
MASTERS = "optimizer.master_weights."  # the mixed-precision container's fp32 weights


def uncompiled(key: str) -> str:
    """`key` without the `_orig_mod.` segments that `torch.compile`d submodules add."""
    return _COMPILED.sub(r"\1", key)


def to_torchtitan(key: str) -> str:
    """Our flat checkpoint key -> torchtitan's key for the same value."""
    return key.removeprefix("model.") if key.startswith("model.") else _RENAMED.get(key, key)


def from_torchtitan(key: str) -> str:
    """torchtitan's flat checkpoint key (without `_orig_mod.`) -> ours."""
    if key.split(".", 1)[0] not in SECTIONS:
        return f"model.{key}"
    return _RENAMED_BACK.get(key, key)


def _weight(key: str, meta: Any) -> bool:
    """Whether a saved entry is a model weight in torchtitan's layout: a top-level tensor."""
    return isinstance(meta, TensorStorageMetadata) and key.split(".", 1)[0] not in SECTIONS


def detect_layout(saved: Mapping[str, Any]) -> Layout | None:
    """Which layout wrote a checkpoint, from its metadata keys (None: neither)."""
    if "lr_scheduler.step" in saved:  # only ours has it; every save of ours has it
        return "ours"
    return "torchtitan" if any(_weight(k, v) for k, v in saved.items()) else None


@dataclass
class Seed:
    """A checkpoint folder that seeds a run: its layout and its keys by our spelling."""

    path: Path
    what: str
    """How errors name it: the config key or the converter's argument."""
    layout: Layout
    saved: Mapping[str, Any]
    """The folder's own keys -> storage metadata (DCP's `state_dict_metadata`)."""
    index: dict[str, str]
    """Our flat key -> the folder's key holding that value."""


def open_seed(path_text: str, model_only: bool, what: str = _KEY) -> Seed:
    """Check `path_text` as a seed folder and read its keys; nothing is loaded yet. `what`
    names it in errors.

    Raises:
        ConfigError: no such folder, a damaged or non-DCP one, neither layout, or one that
            holds weights only when optimizer state is asked for.
    """
    path = Path(path_text)
    where = f"{what} = {path_text!r}"
    if not path.is_dir():
        raise ConfigError(
            f"{where}: no such folder; point it at a checkpoint folder (the one holding "
            f"`.metadata`, e.g. .../checkpoint/step-1000){' or leave it empty' * (what == _KEY)}"
        )
    steps = checkpoint_steps(path)
    if steps and not (path / ".metadata").exists():
        raise ConfigError(
            f"{where}: a folder of checkpoints, not one; point at one of them, e.g. "
            f"{path / f'step-{max(steps)}'}"
        )
    try:
        metadata = verify(path)
    except Damaged as damage:
        raise ConfigError(
            f"{where} is not a usable checkpoint: {damage}; point it at a complete DCP "
            "checkpoint folder"
        ) from None
    saved = metadata.state_dict_metadata
    layout = detect_layout(saved)
    if layout is None:
        raise ConfigError(
            f"{where}: holds neither our layout (model.*, lr_scheduler.step) nor torchtitan's "
            f"(model weights at the top level); its keys: {describe_keys(saved)}. Point it at "
            "a checkpoint of either, or convert others with python -m scripts.convert"
        )
    spell = (lambda k: k) if layout == "ours" else from_torchtitan
    index = {spell(uncompiled(k)): k for k in saved}
    if not model_only and not any(k.startswith("optimizer.state.") for k in index):
        others = [k for k, v in saved.items() if not _weight(k, v)]
        if layout == "torchtitan" and others:  # torchtitan's model-only save has weights alone
            raise ConfigError(
                f"{where}: not a checkpoint of this project nor of torchtitan: it holds no "
                "optimizer state, and not model weights alone as torchtitan's model-only save "
                f"does (also {describe_keys(others)}); point it at a checkpoint saved during "
                "training by either"
            )
        # Refused, not warned: a run that asked for the optimizer state and silently got
        # fresh moments, step 0 and a restarted LR warmup is another run than the one meant.
        wanted = (
            "[checkpoint] initial_load_model_only = false asks for optimizer state too; set "
            "initial_load_model_only = true to seed the weights"
            if what == _KEY
            else "a checkpoint to resume needs optimizer state too; seed a run's weights with "
            f"[checkpoint] initial_load_path = {path_text!r} instead"
        )
        raise ConfigError(
            f"{where}: holds model weights only (torchtitan's last save is model-only unless "
            f"its last_save_model_only = false), but {wanted}, or point at a checkpoint "
            "saved during training"
        )
    return Seed(path, what, layout, saved, index)


def _source(seed: Seed, key: str) -> str | None:
    """The seed's key for our flat `key`; masters fall back to the weights (a seed written
    without the mixed-precision container has no masters: they are the weights)."""
    found = seed.index.get(key)
    if found is None and key.startswith(MASTERS):
        found = seed.index.get(f"model.{key.removeprefix(MASTERS)}")
    return found


def _required(key: str, model_only: bool) -> bool:
    if key.startswith("model."):
        return True
    return not model_only and (
        key.startswith("optimizer.state.") or key in ("lr_scheduler.step", "train_state.step")
    )


def _check(
    seed: Seed, flat: Mapping[str, Any], fill: Mapping[str, str], model_only: bool
) -> set[str]:
    """Refuse a seed of another model before anything loads; return its keys left unused."""
    missing = {k for k in flat if _required(k, model_only) and k not in fill}
    reshaped = set()
    for key, source in fill.items():
        want, meta = flat[key], seed.saved[source]
        if (
            isinstance(want, torch.Tensor)
            and isinstance(meta, TensorStorageMetadata)
            and tuple(meta.size) != tuple(want.shape)
        ):
            reshaped.add(f"{source}: checkpoint {tuple(meta.size)}, model {tuple(want.shape)}")
    used = set(fill.values())
    weights = ("model.",) if model_only else ("model.", "optimizer.state.")
    ours_of = {v: k for k, v in seed.index.items()}
    unused = {k for k in seed.saved if k not in used}
    unexpected = {k for k in unused if ours_of.get(k, "").startswith(weights)}
    (missing, reshaped), (unexpected, unused) = agree_across_ranks(
        (missing, reshaped), (unexpected, unused)
    )
    if missing or unexpected or reshaped:
        raise ConfigError(
            f"{seed.what} = '{seed.path}' ({seed.layout} layout) does not match this job (another "
            f"model or config?): missing keys {describe_keys(missing)}; unexpected keys "
            f"{describe_keys(unexpected)}; shape mismatches {describe_keys(reshaped)}"
        )
    return unused


def load_seed(seed: Seed, states: Mapping[str, Stateful], model_only: bool) -> int:
    """Load `seed` into the job's `states` (model; with `model_only` false also optimizer,
    LR schedule, step and whatever else the seed has a counterpart for); return the step.

    Keys and then the numbers are checked first (another model, or inf or NaN in a value it
    would take, is refused before anything changes). Values the seed does not hold keep this
    job's own (data position and RNG of a torchtitan seed).
    """
    names = [n for n in (("model", "optimizer") if model_only else states) if n in states]
    optimizer = states.get("optimizer")
    forms = ""
    with forgetting_on_failure(dict(states)):
        if not model_only and isinstance(optimizer, OptimizersContainer):
            # First: the template the state dicts below give may depend on the seed's keys.
            keys = {
                k.removeprefix("optimizer."): saved_dtype(seed.saved[source])
                for k, source in seed.index.items()
                if k.startswith("optimizer.")
            }
            try:  # AdamW's state for SGD: said in the container's words
                forms = optimizer.check_checkpoint_keys(keys)
            except ValueError as e:
                raise ConfigError(f"{seed.what} = '{seed.path}': {e}") from None
        flat, mapping = flatten_state_dict({n: states[n].state_dict() for n in names})
        fill = {}
        for key in flat:
            if model_only and not key.startswith(("model.", MASTERS)):
                continue
            source = _source(seed, key)
            if source is not None:
                fill[key] = source
        unused = _check(seed, flat, fill, model_only)
        metadata = dcp.FileSystemReader(seed.path).read_metadata()
        try:
            bad = first_nonfinite(seed.path, metadata, set(fill.values()))
        except Damaged as damage:
            raise ConfigError(f"{seed.what} = '{seed.path}' is damaged: {damage}") from None
        if bad is not None:
            raise ConfigError(
                f"{seed.what} = '{seed.path}' holds inf or NaN (first in {bad}); nothing was "
                "loaded or changed: point it at another checkpoint"
            )
        saved = {k: seed.saved[source] for k, source in fill.items()}
        if converted := "; ".join(filter(None, [dtype_changes(flat, saved), forms])):
            logger.info("%s: converted on load: %s", seed.path, converted)
        _load(seed, flat, fill)
        nested = unflatten_state_dict(flat, mapping)
        loaded = {key.split(".", 1)[0] for key in fill}
        for name in names:
            if name in loaded:
                states[name].load_state_dict(nested[name])
    if model_only and isinstance(optimizer, OptimizersContainer) and optimizer.ema is not None:
        optimizer.ema.restart(f"{seed.what} = '{seed.path}' seeds the weights, not their EMA")
    step = int(nested["train_state"]["step"]) if "train_state" in loaded else 0
    _report(seed, model_only, step, unused)
    return step


def _load(seed: Seed, flat: dict[str, Any], fill: Mapping[str, str]) -> None:
    """DCP-load the seed's values into `flat` (tensors in place, others replaced); one saved
    key may feed several of ours (weights and their fp32 masters)."""
    readers: dict[str, list[str]] = {}
    for key, source in fill.items():
        readers.setdefault(source, []).append(key)
    for source, keys in readers.items():
        # Read into the tensor of the saved dtype (fp32 masters, not bf16 weights), so the
        # others are cast from the saved values and nothing is rounded twice.
        dtype = getattr(getattr(seed.saved[source], "properties", None), "dtype", None)
        keys.sort(key=lambda k: getattr(flat[k], "dtype", None) != dtype)
    request = {source: flat[keys[0]] for source, keys in readers.items()}
    try:
        dcp.load(request, checkpoint_id=seed.path)
    except CheckpointException as e:
        raise ConfigError(f"{seed.what} = '{seed.path}' is damaged: {unreadable(e)}") from None
    for source, keys in readers.items():
        value = request[source]
        for key in keys:
            if isinstance(flat[key], torch.Tensor):
                if flat[key] is not value:
                    flat[key].copy_(value)
            else:
                flat[key] = value


def _report(seed: Seed, model_only: bool, step: int, unused: Collection[str]) -> None:
    what = (
        "model weights (initial_load_model_only = true: optimizer state, LR schedule and "
        "step start fresh)"
        if model_only
        else f"model, optimizer state, LR schedule and step {step}"
    )
    logger.info("seeded from %s (%s layout, %s): %s", seed.path, seed.layout, seed.what, what)
    if unused and not model_only:
        note = ""
        if any(k.startswith("dataloader.dp_rank_") for k in unused):
            note = (
                "; torchtitan's per-rank data loader state cannot be read here: the data "
                "starts at the first sample"
            )
        logger.warning(
            "%s: not used, nothing here takes them: %s%s", seed.path, describe_keys(unused), note
        )
