"""Every `torch.optim` optimizer with the CPU configurations torch's own tests run it with.

A copy of `torch.testing._internal.common_optimizers.optim_db` (torch 2.13, device "cpu",
float32), kept here because importing it needs `expecttest` and changes global torch flags;
`read_torch_optim_db` reads the original, for the test that keeps this copy current.
LBFGS is left out: it needs a closure at every step, which a container's inner optimizers are
never given.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from typing import Any

import torch

TENSOR_LR = "tensor(0.0010)"
"""Stands for `torch.tensor(0.001)`: each container gets its own (`kwargs_of`)."""

LEFT_OUT = {"LBFGS"}

WD = {"weight_decay": 0.1}
MAX_WD = {"weight_decay": 0.1, "maximize": True}

CASES: dict[str, dict[str, dict[str, Any]]] = {
    "Adadelta": {
        "default": {},
        "non-default lr": {"lr": 0.01},
        "nonzero weight_decay": WD,
        "maximize": {"maximize": True},
        "maximize, weight_decay": MAX_WD,
        "rho": {"rho": 0.95, "weight_decay": 0.9},
    },
    "Adafactor": {
        "default": {},
        "nonzero weight_decay": {"weight_decay": 0.1, "lr": 0.01},
        "maximize": MAX_WD,
        "non-default beta2_decay": {"beta2_decay": -1.0},
        "non-default clipping threshold d": {"d": 1.5},
    },
    "Adagrad": {
        "default": {},
        "nonzero weight_decay": WD,
        "maximize": MAX_WD,
        "non-default lr": {"lr": 0.1},
        "initial_accumulator_value": {"initial_accumulator_value": 0.1, "weight_decay": 0.1},
        "lr_decay": {"lr": 0.1, "lr_decay": 0.5, "weight_decay": 0.1},
        "Tensor lr": {"lr": TENSOR_LR},
    },
    **{
        name: {
            "default": {},
            "non-default lr": {"lr": 0.01},
            "nonzero weight_decay": WD,
            "maximize": MAX_WD,
            "amsgrad": {"weight_decay": 0.1, "amsgrad": True},
        }
        for name in ("Adam", "AdamW")
    },
    "Adamax": {
        "default": {},
        "non-default lr": {"lr": 0.1},
        "nonzero weight_decay": WD,
        "maximize": {"maximize": True},
        "maximize, weight_decay": MAX_WD,
    },
    "ASGD": {
        "default": {},
        "non-default lambd": {"lambd": 0.1},
        "non-default lr": {"lr": 0.02},
        "t0": {"t0": 100},
        "maximize": {"maximize": True},
        "nonzero weight_decay": WD,
        "maximize, nonzero weight_decay": MAX_WD,
    },
    "Muon": {
        "default": {},
        "non-default lr": {"lr": 0.01},
        "Tensor lr": {"lr": TENSOR_LR},
        "non-default weight_decay": {"weight_decay": 0.2},
        "non-default momentum": {"momentum": 0.8},
        "passing alternative ns_steps": {"ns_steps": 6},
        "passing alternative ns_coefficients": {"ns_coefficients": (3.4, -4.7, 2.0)},
    },
    "NAdam": {
        "default": {},
        "non-default lr": {"lr": 0.001},
        "non-zero momentum_decay": {"momentum_decay": 0.006},
        "weight_decay": WD,
        "weight_decay, momentum_decay": {"weight_decay": 0.1, "momentum_decay": 0.006},
        "decoupled_weight_decay": {
            "weight_decay": 0.1,
            "momentum_decay": 0.006,
            "decoupled_weight_decay": True,
        },
        "maximize": MAX_WD,
    },
    "RAdam": {
        "default": {},
        "non-default lr": {"lr": 0.002},
        "non-default eps": {"eps": 1e-06},
        "nonzero weight_decay": WD,
        "decoupled_weight_decay": {"weight_decay": 0.1, "decoupled_weight_decay": True},
        "maximize": MAX_WD,
    },
    "RMSprop": {
        "default": {},
        "non-default lr": {"lr": 0.001},
        "nonzero weight_decay": WD,
        "maximize": {"maximize": True},
        "centered": {"weight_decay": 0.1, "centered": True},
        "maximize, weight_decay": {"maximize": True, "weight_decay": 0.1},
        "momentum": {"weight_decay": 0.1, "centered": True, "momentum": 0.1},
        "maximize, centered, weight_decay, w/ momentum": {
            "weight_decay": 0.1,
            "centered": True,
            "momentum": 0.1,
            "maximize": True,
        },
    },
    "Rprop": {
        "default": {},
        "non-default lr": {"lr": 0.0002},
        "non-default etas": {"etas": (0.5, 1.5)},
        "non-default step_sizes": {"step_sizes": (2e-06, 100)},
        "maximize": {"maximize": True},
    },
    "SGD": {
        "default": {},
        "non-default lr": {"lr": 0.01},
        "tensor lr": {"lr": TENSOR_LR},
        "non-zero weight_decay": {"weight_decay": 0.5},
        "momentum": {"momentum": 0.9},
        "maximize": MAX_WD,
        "dampening": {"momentum": 0.9, "dampening": 0.5},
        "weight_decay w/ momentum": {"momentum": 0.9, "weight_decay": 0.1},
        "nesterov": {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
    },
    "SparseAdam": {
        "default": {},
        "non-default lr": {"lr": 0.01},
        "Tensor lr": {"lr": TENSOR_LR},
        "maximize": {"maximize": True},
    },
}


def cases() -> list[tuple[type[torch.optim.Optimizer], str, dict[str, Any]]]:
    """(class, description, kwargs) of every configuration."""
    return [
        (getattr(torch.optim, name), desc, kwargs)
        for name, configs in CASES.items()
        for desc, kwargs in configs.items()
    ]


def kwargs_of(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The constructor kwargs of a case, with a tensor lr of its own."""
    return {k: torch.tensor(0.001) if v == TENSOR_LR else v for k, v in kwargs.items()}


_READ = """
import inspect, torch
from torch.testing._internal.common_optimizers import optim_db
out = {}
for info in optim_db:
    func = info.optim_inputs_func
    kw = {"device": "cpu"}
    if "dtype" in inspect.signature(func).parameters:
        kw["dtype"] = torch.float32
    out[info.optim_cls.__name__] = {
        i.desc: {k: repr(v) if torch.is_tensor(v) else v for k, v in i.kwargs.items()}
        for i in func(**kw)
    }
print(repr(out))
"""


def read_torch_optim_db() -> dict[str, dict[str, dict[str, Any]]]:
    """Torch's own table, read in a subprocess (its import changes global torch flags)."""
    result = subprocess.run(
        [sys.executable, "-c", _READ], capture_output=True, text=True, check=True, timeout=120
    )
    return ast.literal_eval(result.stdout)
