"""The OptimizersContainer hierarchy: one optimizer object over many model parts.

One class runs one step pipeline; the variants are compositions of the parts plugged into it
(`containers.parts`).

    container.py     OptimizersContainer: the step pipeline, the Optimizer and Stateful contract
    contract.py      defaults, global step hooks and the state view kept by hand for torch
    parts.py         the part protocols (Precision, Gate, Timing) with their fp32 / always /
                     after-backward defaults, Outer (none by default), StepReport
    rules.py         the one table of part compositions that cannot work, with their reasons
    quorum.py        torchft replica groups at a quorum: wait_quorum, SettingsMismatch
    norm.py          the global gradient norm over the job's mesh, the finite checks
    tensors.py       local shards, flat views shaped back, the fp32 scratch buffer
    grouped_step.py  like Adam/AdamW groups of many inner optimizers in one kernel call
    ema.py           ShadowWeights: an EMA of the stepped weights, state of the container
    precision/       MasterWeights (mixed precision), its settings and update paths
    gate/            TorchFTGate (torchft)
    timing/          InBackward
    outer/           DiLoCo (torchft local SGD, its outer optimizer and state)
    state/           the flat FQN state format, initial state, param-group rules, FSDP1 slices
    optim/           optimizers the project adds (ShardedMuon, LeanAdam(W), LeanSGD) and the
                     update paths of a param group (`optim.paths`: the one chooser)
"""

from containers.container import OptimizersContainer, Unit
from containers.ema import ShadowWeights
from containers.gate import FTOptimizersContainer, TorchFTGate
from containers.optim import LeanAdam, LeanAdamW, LeanSGD, ShardedMuon
from containers.outer import DiLoCo
from containers.parts import Gate, GateLost, Outer, Precision, StepReport, Timing
from containers.precision import (
    LossScaler,
    MasterWeights,
    MixedPrecisionOptimizersContainer,
    MixedPrecisionSettings,
    load_planner,
)
from containers.quorum import SettingsMismatch
from containers.state import ParamGroupRule
from containers.timing import InBackward, OptimizersInBackwardContainer

__all__ = [
    "DiLoCo",
    "FTOptimizersContainer",
    "Gate",
    "GateLost",
    "InBackward",
    "LeanAdam",
    "LeanAdamW",
    "LeanSGD",
    "LossScaler",
    "MasterWeights",
    "MixedPrecisionOptimizersContainer",
    "MixedPrecisionSettings",
    "OptimizersContainer",
    "OptimizersInBackwardContainer",
    "Outer",
    "ParamGroupRule",
    "Precision",
    "SettingsMismatch",
    "ShadowWeights",
    "ShardedMuon",
    "StepReport",
    "Timing",
    "TorchFTGate",
    "Unit",
    "load_planner",
]
