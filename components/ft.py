"""torchft wiring: the manager of one replica group and the state it serves."""

from __future__ import annotations

import dataclasses
import logging
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from components.agreement import SettingsAgreement
from components.optimizer import OPTIMIZERS, resolve_optimizer
from components.parallelize import stage_group
from config import DILOCO_KEYS, ConfigError, JobConfig
from config import FaultTolerance as FaultToleranceConfig
from config import Optimizer as OptimizerConfig
from containers import DiLoCo, LoadBalance, TorchFTGate
from containers.parts import Gate, Outer
from containers.quorum import lighthouse_address
from containers.update.forms import CODED

if TYPE_CHECKING:
    from torchft import Manager

    from components.train_spec import ModelBuilder

__all__ = [
    "Heals",
    "build_ft_manager",
    "build_gate",
    "build_load_balance",
    "build_outer",
    "check_ft_config",
    "check_outer",
    "manager_port",
    "math_settings",
    "serve_state",
]

logger = logging.getLogger(__name__)
_MANAGER_PORT_BASE = 29_600
_QUORUM_RETRY_MS = 500
"""How often torchft's manager asks a lighthouse that did not answer again, reconnecting."""

# Keys of [training] that change what a step computes (not how fast, or when it stops).
_TRAINING_MATH = (
    "steps", "local_batch_size", "seq_len", "gradient_accumulation_steps", "global_batch_size",
    "max_norm", "mixed_precision_param", "mixed_precision_reduce", "seed", "dataset",
)  # fmt: skip


def math_settings(cfg: JobConfig) -> dict[str, Any]:
    """The config keys that shape the math of a step, as `"[section] key" -> value`: replica
    groups average their gradients, so they must all train with the same values (the
    optimizer and its hyperparameters, the LR schedule, clip, precision, batch, model, seed).

    `[mixed_precision]` counts only where the container uses it.
    """
    sections: dict[str, dict[str, Any]] = {
        "model": dataclasses.asdict(cfg.model),
        "optimizer": dataclasses.asdict(cfg.optimizer),
        "lr_scheduler": dataclasses.asdict(cfg.lr_scheduler),
        "training": {k: getattr(cfg.training, k) for k in _TRAINING_MATH},
    }
    if cfg.optimizer.container == "mixed_precision":
        sections["mixed_precision"] = dataclasses.asdict(cfg.mixed_precision)
    return {f"[{name}] {k}": v for name, keys in sections.items() for k, v in keys.items()}


def build_gate(cfg: JobConfig, manager: Manager | None) -> Gate | None:
    """The gate of a torchft replica group that averages gradients at every step
    (`TorchFTGate`, groups of another math config refused); None without torchft, or under
    DiLoCo, whose inner steps all commit (`build_outer`)."""
    if manager is None or cfg.fault_tolerance.semi_sync_method == "diloco":
        return None
    lighthouse = lighthouse_address(cfg.fault_tolerance.lighthouse)
    agreement = SettingsAgreement(_group_name(cfg.fault_tolerance), math_settings(cfg), lighthouse)
    return TorchFTGate(manager, agreement=agreement.check, lighthouse=lighthouse)


def build_outer(cfg: JobConfig, manager: Manager | None) -> Outer | None:
    """The outer part of a DiLoCo replica group: its outer step every `sync_steps`
    (`DiLoCo`, its outer optimizer from the registry, groups of another math or DiLoCo
    config refused); None without torchft or DiLoCo."""
    ft = cfg.fault_tolerance
    if manager is None or ft.semi_sync_method != "diloco":
        return None
    cls, kwargs = _outer_optimizer(cfg)
    diloco = {f"[fault_tolerance] {k}": getattr(ft, k) for k in DILOCO_KEYS}
    lighthouse = lighthouse_address(ft.lighthouse)
    agreement = SettingsAgreement(_group_name(ft), {**math_settings(cfg), **diloco}, lighthouse)
    return DiLoCo(
        manager, sync_steps=ft.sync_steps, outer_cls=cls, outer_kwargs=kwargs,
        num_fragments=ft.num_fragments, fragment_sync_delay=ft.fragment_sync_delay,
        fragment_update_alpha=ft.fragment_update_alpha, agreement=agreement.check,
        lighthouse=lighthouse,
    )  # fmt: skip


def build_load_balance(
    cfg: JobConfig,
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]],
    mesh: DeviceMesh | None,
    manager: Manager | None,
    diloco: DiLoCo | None = None,
) -> LoadBalance:
    """The container's MoE load balancing of `layers` (`[model] load_balance_coeff`).

    A step's counts add up over the ranks of each pipeline stage and, under torchft's
    every-step gate, over the replica groups of the step's quorum (a healing group adds
    zeros), so every rank and group moves its biases alike. Under DiLoCo (`diloco`, the job's)
    each group balances on its own tokens between syncs, as its weights drift on their own,
    and each committed outer step averages the biases over the groups.
    """
    every_step = manager is not None and cfg.fault_tolerance.semi_sync_method == "none"
    coeff, group = cfg.model.load_balance_coeff, stage_group(mesh)
    return LoadBalance(layers, coeff, group, manager if every_step else None, diloco)


def _outer_optimizer(cfg: JobConfig) -> tuple[type[Optimizer], dict[str, Any]]:
    """DiLoCo's outer optimizer from the registry, with the outer hyperparameters. Its state
    is as lean as the inner moments (bf16 where they are 8-bit codes) where it has lean state,
    else float32: the inner `moment_dtype` is no request of the outer optimizer's."""
    ft = cfg.fault_tolerance
    outer = OptimizerConfig(
        name=ft.outer_optimizer, lr=ft.outer_lr, weight_decay=0.0,
        momentum=ft.outer_momentum, nesterov=ft.outer_nesterov,
        moment_dtype="bfloat16" if (d := cfg.optimizer.moment_dtype) in CODED else d,
    )  # fmt: skip
    factory = OPTIMIZERS.get(outer.name)
    if factory is not None and "moment_dtype" not in factory(outer)[1]:
        outer = dataclasses.replace(outer, moment_dtype="float32")
    return resolve_optimizer(outer, where="[fault_tolerance]", key="outer_optimizer")


def check_outer(cfg: JobConfig, build_model: ModelBuilder) -> None:
    """Raise `ConfigError` unless DiLoCo's outer optimizer is registered and takes the
    parameters of the model `build_model` makes (on the meta device: no memory, no init),
    before any connection. The outer step updates every parameter, 1-D ones too (which
    e.g. Muon refuses): torch's refusal is one line under `[fault_tolerance]`."""
    ft = cfg.fault_tolerance
    if not (ft.enable and ft.semi_sync_method == "diloco"):
        return
    cls, kwargs = _outer_optimizer(cfg)
    with torch.device("meta"):
        params = [p for p in build_model(cfg.model).parameters() if p.requires_grad]
    try:
        cls(params, **kwargs)
    except (ValueError, TypeError, RuntimeError) as e:
        reason = " ".join(str(e).split())
        raise ConfigError(
            f"[fault_tolerance] outer_optimizer = {ft.outer_optimizer!r}: {reason} (the outer "
            "step updates every parameter of the model); pick one that takes them all, e.g. "
            "'SGD' (DiLoCo's Nesterov momentum, the default)"
        ) from None


def _group_name(cfg: FaultToleranceConfig) -> str:
    """This replica group's name: its torchft replica id, and in a refused group's message."""
    return f"replica_{cfg.replica_id}"


def manager_port(cfg: FaultToleranceConfig) -> int:
    """The replica group's manager port (0: any free one, chosen when torchft binds it)."""
    return cfg.manager_port if cfg.manager_port >= 0 else _MANAGER_PORT_BASE + cfg.replica_id


def check_ft_config(cfg: FaultToleranceConfig, device: torch.device) -> None:
    """Raise `ConfigError` for a `[fault_tolerance]` section that cannot run on `device`
    (checked before any connection: a wrong address would cost a connect timeout)."""
    if not cfg.enable:
        return
    if not (cfg.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")):
        raise ConfigError(
            "[fault_tolerance] lighthouse = '': no lighthouse address; set it (e.g. "
            "http://127.0.0.1:29510) or export TORCHFT_LIGHTHOUSE"
        )
    if cfg.process_group == "nccl" and device.type != "cuda":
        raise ConfigError("[fault_tolerance] process_group = 'nccl': needs CUDA; use 'gloo' on CPU")


def build_ft_manager(
    cfg: FaultToleranceConfig, group_rank: int, group_world_size: int, device: torch.device
) -> Manager | None:
    """The torchft `Manager` of this replica group, or None when `[fault_tolerance]` is off.

    Needs a TCPStore for the replica group at MASTER_ADDR:MASTER_PORT (torchrun starts one).
    """
    if not cfg.enable:
        return None
    # torchft's Rust side logs four INFO lines per step to stderr; warnings only, unless the
    # user asked otherwise (read when the extension starts).
    os.environ.setdefault("RUST_LOG", "warn")
    import torchft

    # torchft logs several INFO lines per step; keep warnings (our own logger says "healed").
    for name in ("torchft", "torchft_quorums", "torchft_commits"):
        logging.getLogger(name).setLevel(logging.WARNING)
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    check_ft_config(cfg, device)
    timeout = timedelta(milliseconds=cfg.process_group_timeout_ms)
    # ProcessGroupBabyGloo never commits on CPU here, so the plain reconfigurable ones.
    pg = (
        ProcessGroupNCCL(timeout=timeout)
        if cfg.process_group == "nccl"
        else ProcessGroupGloo(timeout=timeout)
    )
    try:
        return torchft.Manager(
            pg=pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=cfg.min_replica_size,
            timeout=timeout,
            quorum_timeout=timedelta(milliseconds=cfg.quorum_timeout_ms),
            connect_timeout=timedelta(milliseconds=cfg.connect_timeout_ms),
            rank=group_rank,
            world_size=group_world_size,
            lighthouse_addr=cfg.lighthouse or None,
            replica_id=_group_name(cfg),
            port=manager_port(cfg),
            # Every replica initializes from the same seed, so step 0 needs no weight sync.
            init_sync=False,
            # DiLoCo (as torchft's own requires): a healing group takes its peer's state at
            # the sync's quorum, before it computes its pseudo-gradients.
            use_async_quorum=cfg.semi_sync_method != "diloco",
            # torchft's manager gives up a quorum at the first failed call to the lighthouse
            # (and then never answers: the group waits out the quorum timeout, then dies).
            # Retried, it reconnects every _QUORUM_RETRY_MS and carries on with a lighthouse
            # that came back within the quorum timeout.
            quorum_retries=max(1, cfg.quorum_timeout_ms // _QUORUM_RETRY_MS),
        )
    except RuntimeError as e:
        if "failed to connect" not in str(e):
            raise
        address = lighthouse_address(cfg.lighthouse)
        raise ConfigError(
            f"[fault_tolerance] lighthouse = {address!r}: no lighthouse answered within "
            f"connect_timeout_ms = {cfg.connect_timeout_ms}; start it first "
            "(torchft_lighthouse --bind HOST:PORT --min_replicas 1) or fix the address"
        ) from None


@dataclasses.dataclass
class Heals:
    """How often this replica group healed: loaded a live peer's state (`serve_state`).

    A step during which the count grows ran its forward (and, under DiLoCo, its inner step)
    on the weights from before the heal, at an earlier step: what it measured there is not
    the step's whose number the group takes from its peer.
    """

    count: int = 0


def serve_state(manager: Manager, states: dict[str, Stateful]) -> Heals:
    """Make `manager` serve `states` to healing peers and load theirs when healing; returns
    the count of those heals.

    The state is built when a peer asks for it, never cached: tensors by reference and
    scalars (lr, step) as they are at that moment. Call it once the LR schedulers exist.
    Each rank of a replica group serves its own shards (DTensors, as they are) to the rank
    of the same group rank in a healing group, which holds the same shards of the same mesh.
    """
    heals = Heals()

    def state_dict() -> dict[str, Any]:
        return {name: _picklable(obj.state_dict()) for name, obj in states.items()}

    def load_state_dict(state: dict[str, Any]) -> None:
        for name, obj in states.items():
            obj.load_state_dict(state[name])
        heals.count += 1
        logger.info("healed from a peer replica group")

    manager.register_state_dict_fn("train", load_state_dict, state_dict)
    return heals


def _picklable(state: Any) -> Any:
    """`state` with every DTensor over a view at a storage offset (the mixed-precision
    container's state views of its flat buffers) re-made over a copy of its local piece:
    torch pickles a DTensor as a wrapper only where its `data_ptr()` is 0, so such a view
    is pickled as a plain tensor of its (empty) wrapper storage and fails ("invalid python
    storage"), and torchft sends the state pickled. The copies live while a peer is served."""
    if isinstance(state, dict):
        return {k: _picklable(v) for k, v in state.items()}
    if isinstance(state, DTensor) and state.data_ptr() != 0:
        return DTensor.from_local(
            state.to_local().clone(), state.device_mesh, state.placements,
            shape=state.shape, stride=state.stride(), run_check=False,
        )  # fmt: skip
    return state
