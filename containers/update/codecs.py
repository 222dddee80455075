"""The tables of codecs, by the name a config gives them: moments (`moment_dtype`) and
masters (what the kernel steps for a parameter). A new storage format is a module with its
codec and one line here."""

from __future__ import annotations

import torch

from containers.update.codes8 import Codes8
from containers.update.masters import Fp32Masters, MasterCodec, Remainders
from containers.update.moments import Dense, MomentCodec

__all__ = ["MASTER_CODECS", "MOMENT_CODECS"]

MOMENT_CODECS: dict[str, MomentCodec] = {
    "float32": Dense(torch.float32),
    "bfloat16": Dense(torch.bfloat16),
    "8bit": Codes8(),
}

MASTER_CODECS: dict[str, MasterCodec] = {
    "param": MasterCodec(),
    "fp32": Fp32Masters(),
    "remainders": Remainders(),
}
