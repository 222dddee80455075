"""The `[optimizer]` section and its `[[optimizer.param_groups]]` tables."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from config.fields import bounded
from containers.update.forms import MOMENT_CODECS

__all__ = ["AdjustLR", "Implementation", "MomentDtype", "NSDtype", "Optimizer", "ParamGroup"]

Implementation = Literal["auto", "fused", "foreach", "for-loop", "compiled"]
NSDtype = Literal["auto", "bfloat16", "float32"]
AdjustLR = Literal["original", "match_rms_adamw"]
MomentDtype = Literal[tuple(MOMENT_CODECS)]  # type: ignore[valid-type]  (the library's table)


@dataclass(kw_only=True)
class ParamGroup:
    """Per-group overrides for the parameters whose FQN matches `pattern`.

    A field left unset keeps the `[optimizer]` value. Each trainable parameter may match at
    most one group; parameters that match none form the default group.
    """

    pattern: str
    """Regular expression searched (`re.search`) in each parameter's FQN."""

    name: str | None = None
    """Optimizer for this group if not the `[optimizer]` one (its own inner optimizer)."""

    lr: float | None = bounded(None, gt=0.0)
    """Learning rate of this group."""

    weight_decay: float | None = bounded(None, ge=0.0)
    """Weight decay of this group (0.0 for biases, norms and embeddings is common)."""

    beta1: float | None = bounded(None, ge=0.0, lt=1.0)
    """First-moment decay of this group (Adam family)."""

    beta2: float | None = bounded(None, ge=0.0, lt=1.0)
    """Second-moment decay of this group (Adam family)."""

    eps: float | None = bounded(None, gt=0.0)
    """Denominator epsilon of this group (Adam family, Adagrad)."""

    momentum: float | None = bounded(None, ge=0.0, lt=1.0)
    """Momentum of this group (SGD, Muon)."""

    nesterov: bool | None = None
    """Nesterov momentum in this group (SGD, Muon)."""

    ns_steps: int | None = bounded(None, ge=1, lt=100)
    """Newton-Schulz iterations of this group (Muon)."""

    adjust_lr_fn: AdjustLR | None = None
    """Per-matrix lr scaling of this group (Muon)."""

    ns_dtype: NSDtype | None = None
    """Newton-Schulz dtype of this group (Muon)."""

    beta2_decay: float | None = bounded(None, le=0.0)
    """Second-moment decay exponent of this group (Adafactor)."""

    d: float | None = bounded(None, ge=0.0)
    """Update clipping threshold of this group (Adafactor)."""

    eps1: float | None = bounded(None, ge=0.0)
    """Denominator epsilon of this group (Adafactor)."""

    eps2: float | None = bounded(None, ge=0.0)
    """Parameter-scale floor of this group (Adafactor)."""

    moment_dtype: MomentDtype | None = None
    """Dtype of this group's Adam/AdamW moments or SGD/Muon momentum (unset: the section's;
    the section's "8bit" is bf16 for SGD and Muon)."""


@dataclass(kw_only=True)
class Optimizer:
    name: str = "AdamW"
    """Optimizer from the registry (`components.optimizer.register_optimizer`)."""

    lr: float = bounded(3e-3, gt=0.0)
    """Peak learning rate."""

    beta1: float = bounded(0.9, ge=0.0, lt=1.0)
    """First-moment decay (Adam family)."""

    beta2: float = bounded(0.95, ge=0.0, lt=1.0)
    """Second-moment decay (Adam family)."""

    eps: float = bounded(1e-8, gt=0.0)
    """Denominator epsilon (Adam family, Adagrad; Muon keeps its own 1e-7)."""

    weight_decay: float = bounded(0.1, ge=0.0)
    """Weight decay (decoupled for AdamW, Muon and Adafactor; L2 for the others)."""

    momentum: float | None = bounded(None, ge=0.0, lt=1.0)
    """Momentum (SGD, Muon); unset: the optimizer's own default (SGD 0.0, Muon 0.95), so a
    Muon group never trains without momentum unless asked to."""

    nesterov: bool | None = None
    """Nesterov momentum (SGD, Muon); unset: the optimizer's own default (SGD false, Muon
    true). SGD takes it only with a momentum above 0."""

    ns_steps: int = bounded(5, ge=1, lt=100)
    """Newton-Schulz iterations that orthogonalize each update matrix (Muon)."""

    adjust_lr_fn: AdjustLR = "original"
    """How Muon scales lr for an (A, B) matrix: "original" by sqrt(max(1, A / B)) (Keller
    Jordan's Muon), "match_rms_adamw" by 0.2 * sqrt(max(A, B)) (Moonshot's), which gives
    updates AdamW's RMS, so Muon takes AdamW's lr and weight decay."""

    ns_dtype: NSDtype = "auto"
    """Dtype of Muon's Newton-Schulz iterations: "bfloat16" as torch's Muon, "float32" (exact
    to rounding), or "auto": bfloat16 on CUDA, float32 on CPU (bf16 matrix products are
    ~65x slower there without bf16 units)."""

    beta2_decay: float = bounded(-0.8, le=0.0)
    """Adafactor's second-moment decay exponent: beta2 at step t is 1 - t ** beta2_decay."""

    d: float = bounded(1.0, ge=0.0)
    """Adafactor's update clipping threshold (the RMS an update is clipped to)."""

    eps1: float | None = bounded(None, ge=0.0)
    """Adafactor's epsilon1 (torch's `eps[0]`), the floor of the second-moment denominator;
    unset: the machine epsilon of the parameters' dtype."""

    eps2: float = bounded(1e-3, ge=0.0)
    """Adafactor's epsilon2 (torch's `eps[1]`), the floor of the parameter scale, so that
    weights near zero still move."""

    moment_dtype: MomentDtype = "float32"
    """Dtype Adam/AdamW keep their two moments in, and SGD/Muon their momentum: "bfloat16"
    halves their memory (Adam: 4 bytes a parameter instead of 8); the update is still fp32
    math (Adam: torch's fused kernel on each chunk of moments widened to fp32; SGD, Muon: per
    tensor), rounded back to nearest. Checkpoints of either load into either. "8bit" (Adam and
    AdamW, not under FSDP1): 8-bit codes in blocks of 32 within a row, 2.25 bytes a parameter
    (`containers.update.codes8`; on a GPU step them with implementation
    "compiled"); "4bit": two codes a byte in the same blocks, 1.25 bytes a parameter
    (`containers.update.codes4`). Under codes, 1-D parameters and rows of 4 or fewer keep
    bf16 moments, and param groups of SGD or Muon that inherit it their momentum in bf16."""

    implementation: Implementation = "auto"
    """Kernel: "auto" picks fused where torch supports it on the parameters' device (and
    DTensor runs it), else torch's default; Muon has one per-tensor kernel only ("auto" or
    "for-loop"). "compiled" (Adam and AdamW): each param group steps as one `torch.compile`d
    (inductor) graph that reads and writes every moment in its own dtype (8-bit codes decoded
    and encoded in it), a few fp32 ulp from the fused kernel: for GPUs (an H100 against the
    default fp32 AdamW step: bf16 moments 0.88x, against 1.95x through the fused kernel;
    8-bit moments 1.9x, against 11.9x; on a CPU slower than its one-pass kernel); compiling
    takes seconds per group shape on first use. It applies to every param group's
    optimizer."""

    container: str = "default"
    """Optimizer container from the registry (`components.optimizer.register_container`):
    "default", "mixed_precision" (bf16/fp16 parameters, fp32 masters), "in_backward" (=
    "default" with `early_step_in_backward`), "fault_tolerant" (needs [fault_tolerance])."""

    early_step_in_backward: bool = False
    """Step each unit of parameters inside backward as soon as its gradients are final and
    free them (no whole-model gradient buffer); composes with "mixed_precision" (bf16)."""

    param_groups: list[ParamGroup] = field(default_factory=list)
    """Per-group overrides as a TOML array of tables `[[optimizer.param_groups]]`."""
