"""Convert checkpoints between our layout, torchtitan's, and plain `torch.save` files.

    python -m scripts.convert SRC DST [--step N] [train.py config arguments ...]

SRC decides the direction (one process, CPU only, no process group):

- one of our checkpoint folders (`.../checkpoint/step-N`) -> DST in torchtitan 0.3.0's layout:
  model weights at the top level, `lr_scheduler.last_epoch`, `train_state.step` and
  `ntokens_seen`; what torchtitan has no place for (our data position, RNG, skip count,
  mixed-precision masters) stays in the folder under our names, where torchtitan's loader
  does not read it and a conversion back finds it. No config needed.
- a torchtitan checkpoint folder -> DST in our layout, for the job that the config arguments
  describe (as train.py takes them; default: train.py's defaults): its keys are checked
  against that job's model and optimizer, and what torchtitan did not save (data position,
  RNG) is a fresh run's.
- a `torch.save` file holding {"model": state_dict, "optimizer": Optimizer.state_dict()} ->
  DST in our layout; the optimizer's parameter ids are mapped to FQNs through the config's
  model (its `named_parameters()` order, or the groups' `param_names` when saved).
  `--step N` sets the train step and LR schedule position (default 0).

Name DST `<dump_folder>/checkpoint/step-N` and train.py resumes it at any world size, or
seed a run from it with `[checkpoint] initial_load_path`.

A SRC it cannot use (unreadable, damaged, of another layout) or a DST it cannot write ends in
one line saying what is wrong, exit 2, with nothing written.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from components.checkpoint.files import describe, unreadable
from components.checkpoint.seed import MASTERS, load_seed, open_seed, to_torchtitan, uncompiled
from components.job import Job, build_job
from components.train_spec import get_train_spec
from config import ConfigError, load_job_config
from containers.state.flat import describe_keys

logger = logging.getLogger("convert")

# The job is only a template of keys and shapes: one process holds every part.
_ONE_PROCESS = [
    "--parallelism.pipeline_parallel_degree", "1",
    "--parallelism.tensor_parallel_degree", "1",
    "--parallelism.data_parallel_replicate_degree", "1",
    "--parallelism.data_parallel_shard_degree", "-1",
    "--fault_tolerance.enable", "false",
    "--checkpoint.enable", "false",
]  # fmt: skip


def _read_all(path: Path) -> dict[str, Any]:
    """Every value of a DCP folder, flat (keys as saved), as full CPU tensors."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    flat: dict[str, Any] = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        if isinstance(m, TensorStorageMetadata)
        else None  # a pickled value: DCP replaces it
        for k, m in saved.items()
    }
    try:
        dcp.load(flat, checkpoint_id=path, no_dist=True)
    except CheckpointException as e:
        raise ConfigError(f"SRC = '{path}' is damaged: {unreadable(e)}") from None
    return flat


def _write(state: dict[str, Any], dst: Path) -> None:
    """DCP-save `state` to `dst.tmp`, then rename it to `dst` (a crash leaves no `dst`)."""
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        dcp.save(state, checkpoint_id=tmp, no_dist=True)
        os.replace(tmp, dst)
    except (OSError, CheckpointException) as e:
        raise ConfigError(f"DST = '{dst}' cannot be written ({describe(e)})") from None
    logger.info("wrote %s", dst)


def ours_to_torchtitan(src: Path, dst: Path) -> None:
    """Write our checkpoint folder `src` in torchtitan's layout at `dst`."""
    flat = _read_all(src)
    out: dict[str, Any] = {}
    for key, value in flat.items():
        titan = to_torchtitan(key)
        if key.startswith("model."):
            out[titan] = value
        else:
            section, rest = titan.split(".", 1)
            out.setdefault(section, {})[rest] = value
    # torchtitan counts tokens; ours counts samples (global, each of seq_len tokens).
    samples, seq_len = flat.get("dataloader.sample_index"), flat.get("dataloader.seq_len")
    tokens = samples * seq_len if samples is not None and seq_len is not None else 0
    out["train_state"]["ntokens_seen"] = tokens
    _write(out, dst)
    logger.info(
        "torchtitan loads it with --checkpoint.exclude_from_loading dataloader (its per-rank "
        "data loader state cannot be made from ours); kept under our names for a way back: %s",
        describe_keys(k for k in flat if not _torchtitan_reads(k)),
    )


def _torchtitan_reads(key: str) -> bool:
    """Whether torchtitan's trainer loads our flat `key` (under its own name)."""
    return key.startswith(("model.", "optimizer.state.", "optimizer.param_groups.")) or (
        to_torchtitan(key) in ("lr_scheduler.last_epoch", "train_state.step")
    )


def _job(config_args: list[str], dump: str) -> Job:
    """This config's job in one process on CPU: the template a converted folder must fit."""
    cfg = load_job_config([*config_args, *_ONE_PROCESS, "--job.dump_folder", dump])
    return build_job(cfg)


def torchtitan_to_ours(src: Path, dst: Path, config_args: list[str], dump: str) -> int:
    """Write torchtitan's checkpoint folder `src` in our layout at `dst`; return its step."""
    seed = open_seed(str(src), model_only=False, what="SRC")
    job = _job(config_args, dump)
    step = load_seed(seed, job.checkpoint.states, model_only=False)
    _write(job.checkpoint.states, dst)
    return step


def _fqns_of_ids(groups: list[dict[str, Any]], names: list[str]) -> dict[int, str]:
    """torch optimizer parameter id -> FQN: the groups' `param_names` when the optimizer was
    built from named parameters, else the model's `named_parameters()` order."""
    if all("param_names" in g for g in groups):
        return {i: uncompiled(n) for g in groups for i, n in zip(g["params"], g["param_names"])}
    ids = [i for g in groups for i in g["params"]]
    if len(ids) != len(names):
        raise ConfigError(
            f"the optimizer holds {len(ids)} parameters, the config's model {len(names)}; "
            "pass the config of the model it trained (--job.config_file, --model.*)"
        )
    return dict(zip(ids, names))


def _optimizer_flat(src: Path, osd: dict[str, Any], shapes: dict[str, torch.Size]) -> dict:
    """torch's id-keyed optimizer state dict as our flat FQN-keyed one (shapes checked)."""
    fqn = _fqns_of_ids(osd["param_groups"], list(shapes))
    strangers = set(fqn.values()) - shapes.keys()
    if strangers:
        raise ConfigError(
            f"{src}: the optimizer names parameters the config's model lacks "
            f"{describe_keys(strangers)}; pass the config of the model it trained"
        )
    flat: dict[str, Any] = {}
    bad = []
    for pid, state in osd["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != shapes[fqn[pid]]:
                bad.append(f"id {pid} -> {fqn[pid]}: {name} {tuple(value.shape)}")
            flat[f"state.{fqn[pid]}.{name}"] = value
    if bad:
        raise ConfigError(
            f"{src}: optimizer state does not fit the parameters in the model's order "
            f"{describe_keys(bad)}; build the optimizer from model.named_parameters() so its "
            "state_dict names them, or pass the config of the model it trained"
        )
    for group in osd["param_groups"]:
        for pid in group["params"]:
            for key, value in group.items():
                if key not in ("params", "param_names"):
                    flat[f"param_groups.{fqn[pid]}.{key}"] = value
    return flat


_EXPECTED = (
    "expected a dict with 'model' (a model state_dict) and 'optimizer' (torch's "
    "Optimizer.state_dict()), as torch.save wrote them"
)


def _optimizer_form(osd: Any) -> bool:
    """Whether `osd` has the form of torch's `Optimizer.state_dict()`: groups listing integer
    parameter ids, and per-parameter state by those ids."""
    groups = osd.get("param_groups") if isinstance(osd, dict) else None
    if not isinstance(groups, list) or not isinstance(osd.get("state"), dict):
        return False
    if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        return False
    ids = [i for g in groups for i in g["params"]]
    if not all(isinstance(i, int) for i in ids):
        return False
    known = set(ids)
    return all(i in known and isinstance(s, dict) for i, s in osd["state"].items())


def _read_torch_file(src: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model and optimizer state dicts of a `torch.save` file, their form checked.

    Raises:
        ConfigError: torch.load cannot read it, or it holds something else.
    """
    try:
        saved = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as e:  # random bytes, another format: torch raises any of several types
        raise ConfigError(
            f"{src}: torch.load(weights_only=True) cannot read it ({type(e).__name__}); {_EXPECTED}"
        ) from None
    if not isinstance(saved, dict) or not {"model", "optimizer"} <= saved.keys():
        found = sorted(saved, key=str) if isinstance(saved, dict) else type(saved).__name__
        raise ConfigError(f"{src}: holds {found}; {_EXPECTED}")
    model, osd = saved["model"], saved["optimizer"]
    if not isinstance(model, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()
    ):
        raise ConfigError(f"{src}: its 'model' is not a state_dict of named tensors; {_EXPECTED}")
    if not _optimizer_form(osd):
        found = describe_keys(map(str, osd)) if isinstance(osd, dict) else type(osd).__name__
        raise ConfigError(
            f"{src}: its 'optimizer' (holding {found}) is not torch's Optimizer.state_dict() "
            f"('state' by parameter id, 'param_groups' listing those ids); {_EXPECTED}"
        )
    return model, osd


def torch_file_to_ours(src: Path, dst: Path, config_args: list[str], dump: str, step: int) -> None:
    """Write a `torch.save` file {"model", "optimizer"} in our layout at `dst`."""
    model_sd, osd = _read_torch_file(src)
    job = _job(config_args, dump)
    with torch.device("meta"):  # names and shapes only
        model = get_train_spec(job.cfg.model.name).build_model_fn(job.cfg.model)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    weights = {uncompiled(k): v for k, v in model_sd.items()}
    ours = {k: v.shape for part in job.model_parts for k, v in part.state_dict().items()}
    reshaped = [
        f"{k}: file {tuple(v.shape)}, config {tuple(ours[k])}"
        for k, v in weights.items()
        if k in ours and v.shape != ours[k]
    ]
    if weights.keys() != ours.keys() or reshaped:
        raise ConfigError(
            f"{src}: its model does not match the config's (another model or flavor?): "
            f"missing keys {describe_keys(ours.keys() - weights.keys())}; unexpected keys "
            f"{describe_keys(weights.keys() - ours.keys())}; shape mismatches "
            f"{describe_keys(reshaped)}"
        )
    flat = _optimizer_flat(src, osd, shapes)
    # The container's own entries (mixed precision: fp32 masters, which are the weights, and
    # its loss scaler) come from the weights and from this job.
    masters = MASTERS.removeprefix("optimizer.")
    for key, value in job.optimizers.state_dict().items():
        if key.startswith(masters):
            flat[key] = weights[key.removeprefix(masters)]
        elif not key.startswith(("state.", "param_groups.")):
            flat.setdefault(key, value)
    for part in job.model_parts:
        part.load_state_dict({k: weights[k] for k in part.state_dict()})
    try:  # AdamW's state for SGD: said in the container's words
        job.optimizers.load_state_dict(flat)
    except ValueError as e:
        raise ConfigError(f"{src}: {e}") from None
    job.lr_schedulers.load_state_dict({"step": step})
    job.train_state.step = step
    _write(job.checkpoint.states, dst)


def main(argv: list[str]) -> int:
    """Convert; return the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m scripts.convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Other --section.key arguments are train.py's config (conversions into ours).",
    )
    parser.add_argument("src", type=Path, help="our or torchtitan's DCP folder, or a .pt file")
    parser.add_argument("dst", type=Path, help="the folder to write (must not exist)")
    parser.add_argument("--step", type=int, default=0, help="train step of a torch.save file")
    args, config_args = parser.parse_known_args(argv)
    src, dst = args.src, args.dst
    if dst.exists():
        raise ConfigError(f"DST = '{dst}' exists; remove it or name another folder")
    if not src.exists():
        raise ConfigError(f"SRC = '{src}': no such file or folder")
    # A folder is checked and its layout read from its DCP metadata; a file is torch.save's.
    layout = "torch.save" if src.is_file() else open_seed(str(src), True, what="SRC").layout
    if layout == "ours" and config_args:
        raise ConfigError(
            f"config arguments {config_args} are for conversions into our layout; {src} is "
            "ours already (it converts to torchtitan's without one)"
        )
    with tempfile.TemporaryDirectory(prefix="convert-") as dump:
        if layout == "ours":
            ours_to_torchtitan(src, dst)
            return 0
        if layout == "torchtitan":
            step = torchtitan_to_ours(src, dst, config_args, dump)
        else:
            step = args.step
            torch_file_to_ours(src, dst, config_args, dump, step)
    match = re.fullmatch(r"step-(\d+)", dst.name)
    if match is None or int(match.group(1)) != step:
        logger.warning(
            "%s holds step %d: name it step-%d under <dump_folder>/checkpoint to resume it with "
            "train.py, or seed a run with --checkpoint.initial_load_path %s "
            "--checkpoint.initial_load_model_only false",
            dst, step, step, dst,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    warnings.filterwarnings("ignore", "torch.distributed is disabled")  # one process: meant
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # CPU only, set before CUDA starts
    try:
        sys.exit(main(sys.argv[1:]))
    except ConfigError as e:
        logger.error("error: %s", e)
        sys.exit(2)
