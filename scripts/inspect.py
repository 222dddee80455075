"""List what a DCP checkpoint folder holds, grouped by kind, from its metadata.

    python -m scripts.inspect STEP_FOLDER [--all] [--quick]

One process, no process group, nothing of the model built: the keys come from DCP's
`.metadata`, read by the trainer's own check of a folder (`components.checkpoint.files.verify`),
with shapes, dtypes and bytes; the small non-tensor values (step, lr, loss scale, data
position) are read from the folder. Groups: model weights (each key; `--all` lists every key of
every group), optimizer state by state name, param-group settings by key with their distinct
values, other optimizer entries (master weights, loss scaler), then train state, LR schedule,
data loader, torchft's manager (a fault-tolerant run's) and the rest. Our layout and
torchtitan's (weights at the top level) both read.

A folder that train.py refuses as damaged (the `.metadata` unreadable, a file it names missing
or truncated, a tensor holding inf or NaN: the trainer's own checks, `verify` and
`first_nonfinite`), or whose saved values cannot be read, is one line naming what, exit 2.
The inf/NaN check reads every tensor once; `--quick` skips it.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from components.checkpoint.files import Damaged, unreadable, verify
from components.checkpoint.finite import first_nonfinite
from components.checkpoint.seed import Layout, detect_layout

__all__ = ["describe", "main"]

_SECTIONS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")
_FT = "ft_manager"  # where a fault-tolerant run saves torchft's manager (its step count)


@dataclass
class _Group:
    tensors: list[tuple[str, TensorStorageMetadata]] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)


def _nbytes(meta: TensorStorageMetadata) -> int:
    return meta.size.numel() * torch.empty((), dtype=meta.properties.dtype).element_size()


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable: the loop returns at GiB


def _dtype(meta: TensorStorageMetadata) -> str:
    return str(meta.properties.dtype).removeprefix("torch.")


def _kind(key: str, layout: Layout | None, tensor: bool) -> tuple[str, str]:
    """(group, the key's part that names it within the group) of a key of a `layout` folder."""
    head, _, rest = key.partition(".")
    if head == _FT:
        return "torchft's manager", rest
    if head not in _SECTIONS:
        if layout == "torchtitan" and tensor:
            return "model (top level: torchtitan's layout)", key
        return "other (of neither our layout nor torchtitan's)", key
    if head == "optimizer":
        sub, _, name = rest.partition(".")  # state, param_groups, master_weights, ...
        return f"optimizer {sub}", name
    return head, rest


def _order(group: str) -> tuple[int, str]:
    known = ["model", "optimizer state", "optimizer param_groups", "optimizer"]
    known += ["train_state", "lr_scheduler", "dataloader", "torchft"]
    return next(i for i, k in enumerate([*known, ""]) if group.startswith(k)), group


def _tensor_line(label: str, tensors: list[tuple[str, TensorStorageMetadata]]) -> str:
    dtypes = "/".join(sorted({_dtype(m) for _, m in tensors}))
    shapes = {tuple(m.size) for _, m in tensors}
    shape = f", shape {next(iter(shapes))}" if len(shapes) == 1 else ""
    nbytes = sum(_nbytes(m) for _, m in tensors)
    return f"{label}{len(tensors)} tensors, {dtypes}{shape}, {_size(nbytes)}"


def _key_lines(tensors: list[tuple[str, TensorStorageMetadata]]) -> list[str]:
    width = max(len(k) for k, _ in tensors)
    return [
        f"  {k:<{width}}  {tuple(m.size)!s:<12} {_dtype(m):<9} {_size(_nbytes(m))}"
        for k, m in tensors
    ]


def _by_last(items: Iterable[tuple[str, Any]]) -> dict[str, list[tuple[str, Any]]]:
    """Entries keyed `<fqn>.<name>` by `name` (state names, param-group keys)."""
    out: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    for key, value in items:
        out[key.rpartition(".")[2]].append((key, value))
    return out


def _read_values(path: str, keys: list[str]) -> dict[str, Any]:
    """The saved non-tensor values of `keys` (DCP pickles them), read in this process."""
    values: dict[str, Any] = dict.fromkeys(keys)
    with warnings.catch_warnings():  # DCP warns that it loads without a process group
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(values, storage_reader=FileSystemReader(path), no_dist=True)
    return values


def _shown(value: Any) -> str:
    text = f"{value:.6g}" if isinstance(value, float) else repr(value)
    return text if len(text) <= 60 else f"<{type(value).__name__}, {len(text)} chars>"


def describe(path: str, every_key: bool = False, finite_check: bool = True) -> str:
    """The listing that `python -m scripts.inspect path` prints; `finite_check` reads every
    floating-point tensor for inf or NaN first, as train.py does before it loads.

    Raises:
        Damaged: what makes train.py refuse the folder, or its values unreadable.
    """
    metadata = verify(Path(path), checksums=finite_check)  # (--quick reads no value)
    saved = metadata.state_dict_metadata
    layout = detect_layout(saved)
    groups: dict[str, _Group] = defaultdict(_Group)
    scalars = []
    for key, meta in saved.items():
        tensor = isinstance(meta, TensorStorageMetadata)
        name, short = _kind(key, layout, tensor)
        if tensor:
            groups[name].tensors.append((short, meta))
        elif isinstance(meta, BytesStorageMetadata):
            scalars.append(key)
    try:
        values = _read_values(path, scalars)
    except CheckpointException as e:
        raise unreadable(e) from None
    if finite_check and (bad := first_nonfinite(Path(path), metadata)) is not None:
        raise Damaged(bad, "holds inf or NaN, which train.py refuses to load")
    for key in scalars:
        name, short = _kind(key, layout, tensor=False)
        groups[name].values[short] = values[key]
    step = next((values[k] for k in ("train_state.step", "lr_scheduler.step") if k in values), None)
    if step is None:
        step = values.get("lr_scheduler.last_epoch", "unknown")
    files = [f for f in Path(path).iterdir() if f.suffix == ".distcp"]
    total = sum(f.stat().st_size for f in files)
    lines = [
        f"{path}: step {step}; {len(saved)} keys, {_size(total)} in {len(files)} .distcp files"
    ]
    for name in sorted(groups, key=_order):
        group = groups[name]
        if name == "optimizer state":
            lines.append("optimizer state, by name:")
            by_name = _by_last(group.tensors)
            width = max(map(len, by_name))
            for state, tensors in by_name.items():
                lines.append(_tensor_line(f"  {state:<{width}}  ", tensors))
                lines += _key_lines(tensors) if every_key else []
            continue
        if name == "optimizer param_groups":
            by_key = _by_last(group.values.items())
            params = max(len(v) for v in by_key.values())
            lines.append(f"optimizer param groups, by key ({params} parameters; the values):")
            width = max(map(len, by_key))
            for key, entries in by_key.items():
                distinct = sorted({_shown(v) for _, v in entries})
                lines.append(f"  {key:<{width}}  {', '.join(distinct)}")
            continue
        if group.tensors:
            lines.append(_tensor_line(f"{name}: ", group.tensors))
            if name.startswith("model") or every_key or len(group.tensors) <= 4:
                lines += _key_lines(group.tensors)
        if group.values:
            shown = ", ".join(f"{k} = {_shown(v)}" for k, v in group.values.items())
            lines.append(f"{name}: {shown}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.inspect", description=__doc__)
    parser.add_argument("folder", help="a checkpoint folder (the one holding .metadata)")
    parser.add_argument("--all", action="store_true", help="list every key of every group")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="skip reading every tensor for inf or NaN (train.py checks it before loading)",
    )
    args = parser.parse_args(argv)
    if not (Path(args.folder) / ".metadata").is_file():
        print(
            f"error: {args.folder} holds no .metadata: not a DCP checkpoint folder; point at "
            "one of <dump_folder>/checkpoint/step-N",
            file=sys.stderr,
        )
        return 2
    try:
        print(describe(args.folder, args.all, finite_check=not args.quick))
    except Damaged as damage:
        print(f"error: {args.folder} is damaged: {damage}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
