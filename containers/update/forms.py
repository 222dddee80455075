"""The tables of codecs, by the name a config gives them (`moment_dtype`; what the kernel
steps for a parameter), and the stored-form questions a build, a load or a save asks of them.
A new storage format is a module with its codec and one line in `MOMENT_CODECS`."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from containers.update.codecs import (
    Dense,
    Fp32Masters,
    MasterCodec,
    MomentCodec,
    Remainders,
    RowCodes,
)
from containers.update.codes4 import Codes4
from containers.update.codes8 import Codes8

__all__ = [
    "CODED",
    "MASTER_CODECS",
    "MOMENT_CODECS",
    "check_moment_dtype",
    "coded_codec",
    "in_form_of",
    "kept_as",
    "to_values",
]

MOMENT_CODECS: dict[str, MomentCodec] = {
    "float32": Dense(torch.float32),
    "bfloat16": Dense(torch.bfloat16),
    "8bit": Codes8(),
    "4bit": Codes4(),
}

MASTER_CODECS: dict[str, MasterCodec] = {
    "param": MasterCodec(),
    "fp32": Fp32Masters(),
    "remainders": Remainders(),
}

CODED = frozenset(name for name, c in MOMENT_CODECS.items() if c.adam_only)
"""The `moment_dtype`s that code Adam's moments (other optimizers keep their bf16 form)."""


def check_moment_dtype(group: Mapping[str, Any], owner: str = "", codes: bool = False) -> None:
    """Raise ValueError unless `moment_dtype` names a codec (an `adam_only` one if `codes`)."""
    name = group.get("moment_dtype", "float32")
    known = [n for n in MOMENT_CODECS if codes or n not in CODED]
    if name in known:
        return
    if name in CODED:
        raise ValueError(
            f"{owner} moment_dtype = {name!r}: codes are Adam's and AdamW's moments; use "
            "'bfloat16' (2 bytes a value) for this optimizer's state"
        )
    raise ValueError(
        f"moment_dtype = {name!r}: expected one of {known} (how the optimizer's "
        "elementwise state is kept)"
    )


def coded_codec(stored: Any) -> RowCodes | None:
    """The codec whose codes `stored` is (None: a tensor, or no known form)."""
    for codec in MOMENT_CODECS.values():
        if isinstance(codec, RowCodes) and codec.holds(stored):
            return codec
    return None


def to_values(name: str, value: Any, p: Any = None) -> Any:
    """A stored moment as a tensor: codes decoded to fp32 (whole-tensor codes of a sharded
    `p` give its piece); any other value as it is."""
    codec = coded_codec(value)
    return codec.to_values(name, value, p) if codec is not None else value


def kept_as(policy: str, name: str, value: Any, p: torch.Tensor) -> Any:
    """Moment `name` of `p`, loaded as `value` (any form), in the form `policy` keeps."""
    codec = MOMENT_CODECS[policy]
    if isinstance(codec, RowCodes):
        if codec.holds(value) and codec.keeps(p):
            if value[codec.CODE].shape != codec.code_shape(p.shape):
                raise ValueError(
                    f"optimizer state {name}: codes of shape "
                    f"{tuple(value[codec.CODE].shape)} for a parameter of shape "
                    f"{tuple(p.shape)}; load the state of this model"
                )
            return {k: v.to(device=p.device) for k, v in value.items()}
        return codec.from_values(name, to_values(name, value, p), p)
    return to_values(name, value, p).to(device=p.device, dtype=codec.dtype)


def in_form_of(
    p: torch.Tensor,
    state: dict[str, Any],
    keys: Collection[str] | Mapping[str, torch.dtype | None],
    prefix: str,
    materialize: bool,
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """`p`'s `state` with each moment in the form the checkpoint `keys` hold it under `prefix`.

    A moment saved as a tensor (`<prefix>.exp_avg`) or as codes (`<prefix>.exp_avg.code`)
    unlike ours gets a template (zeros, or meta if not `materialize`) that the load converts.
    Tensor templates take the saved dtype from `keys` if given, else fp32.

    Returns:
        The state, and the converted moments as (name, "<saved form> -> <our form>").
    """
    out, changed = state, []
    for name, ours in state.items():
        if not isinstance(ours, (torch.Tensor, dict)):
            continue
        key = f"{prefix}.{name}"
        ours_coded = coded_codec(ours)
        saved: MomentCodec | None = None
        if key in keys and ours_coded is not None:
            kind = keys.get(key) if isinstance(keys, Mapping) else None
            saved = Dense(kind if kind is not None and kind.is_floating_point else torch.float32)
        else:
            saved = next(
                (
                    c
                    for c in MOMENT_CODECS.values()
                    if isinstance(c, RowCodes)
                    and c is not ours_coded
                    and f"{key}.{c.CODE}" in keys
                    and name in c.MOMENTS
                ),
                None,
            )
        if saved is None:
            continue
        out = {**out, name: saved.template(name, p, materialize)}
        ours_label = ours_coded.label if ours_coded is not None else "tensor"
        changed.append((name, f"{saved.label} -> {ours_label}"))
    return out, changed
