"""Rules that involve more than one key, checked when the config is loaded (and, for the world
size, before any process group exists). Each error names the keys, the values and the fix."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from config.errors import ConfigError
from config.job_config import DILOCO_KEYS, JobConfig, Training
from config.optimizer_config import Optimizer as OptimizerConfig
from containers.rules import conflict

__all__ = ["accumulation_steps", "cross_check", "fsdp_mixed_precision", "steps_in_backward"]


def steps_in_backward(cfg: OptimizerConfig) -> bool:
    """Whether the `[optimizer]` section asks for units stepped inside backward."""
    return cfg.early_step_in_backward or cfg.container == "in_backward"


@dataclass(frozen=True)
class _Switch:
    """Keys of `section` that only a feature reads, and the key that turns the feature on."""

    section: str
    on: tuple[str, str, Any]
    """(section, key, value) that turns the feature on."""
    keys: tuple[str, ...] = ()
    """The keys only the feature reads; empty: every key of `section` but the switch."""


_SWITCHES = (
    _Switch("fault_tolerance", ("fault_tolerance", "enable", True), ("semi_sync_method",)),
    _Switch("fault_tolerance", ("fault_tolerance", "semi_sync_method", "diloco"), DILOCO_KEYS),
    _Switch("ema", ("ema", "enable", True)),
    _Switch("mixed_precision", ("optimizer", "container", "mixed_precision")),
    _Switch(
        "checkpoint",
        ("checkpoint", "enable", True),
        ("load_step", "set_aside_newer", "initial_load_path", "initial_load_model_only"),
    ),
)
"""Features that are off unless a key turns them on, and the keys only they read: a key set
for a feature that is off would be ignored silently, so it is refused unless it holds its
default (TOMLs often spell defaults out). Keys of where and how often a feature connects or
saves (`[fault_tolerance] lighthouse`, timeouts, `[checkpoint] interval`, ...) are left out:
switching a TOML's torchft or checkpoints off from the command line is common (e.g.
scripts/convert.py does), and those keys change nothing a run computes or loads."""


def _shown(value: Any) -> str:
    """`value` as it is written in TOML (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _unread(cfg: JobConfig) -> list[str]:
    """A line for each key set (not to its default) for a feature of `_SWITCHES` that is off."""
    found = []
    for switch in _SWITCHES:
        section, key, on = switch.on
        now = getattr(getattr(cfg, section), key)
        if now == on:
            continue
        table = getattr(cfg, switch.section)
        for f in dataclasses.fields(table):
            value = getattr(table, f.name)
            read_anyway = (switch.section, f.name) == (section, key) or (
                switch.keys and f.name not in switch.keys
            )
            if value == f.default or read_anyway:
                continue
            turn_on, where = f"[{section}] {key} = {_shown(on)}", f"[{switch.section}] {f.name}"
            found.append(
                f"{where} = {_shown(value)}: only {turn_on} reads it, and {key} = {_shown(now)}; "
                f"set {turn_on} or remove {where} (with the feature off, only its default "
                f"{_shown(f.default)} is accepted)"
            )
    return found


def _features(cfg: JobConfig) -> dict[str, tuple[str, str]]:
    """The features of `containers.rules` the job's parts bring, each as (the config key that
    brings it, how to turn it off); a section counts only where it is read."""
    opt, ft, mp = cfg.optimizer, cfg.fault_tolerance, cfg.mixed_precision
    found: dict[str, tuple[str, str]] = {}
    if cfg.parallelism.data_parallel_shard_impl == "fsdp1":
        found["fsdp1"] = (
            "[parallelism] data_parallel_shard_impl = 'fsdp1'",
            "use data_parallel_shard_impl = 'fsdp2'",
        )
    if opt.early_step_in_backward:
        found["in_backward"] = (
            "[optimizer] early_step_in_backward = true",
            "set early_step_in_backward = false",
        )
    elif opt.container == "in_backward":
        found["in_backward"] = (
            "[optimizer] container = 'in_backward'",
            "set [optimizer] container = 'default'",
        )
    if cfg.training.max_norm > 0:
        found["clip"] = (f"[training] max_norm = {cfg.training.max_norm}", "set max_norm = 0")
    if ft.enable:
        found["torchft"] = ("[fault_tolerance] enable = true", "disable fault tolerance")
        if ft.semi_sync_method == "diloco":
            found["diloco"] = (
                "[fault_tolerance] semi_sync_method = 'diloco'",
                "set semi_sync_method = 'none'",
            )
    if cfg.ema.enable:
        found["ema"] = ("[ema] enable = true", "set [ema] enable = false")
    if opt.container != "mixed_precision":
        return found
    brought = mp.settings().features()  # the precision's own derivation
    if "loss_scaling" in brought:
        found["loss_scaling"] = (
            f"[mixed_precision] loss_scaling = {mp.loss_scaling!r} with param_dtype "
            f"{mp.param_dtype!r}",
            "use bfloat16 with loss_scaling 'none'",
        )
    if "fp32_sums" in brought:
        found["fp32_sums"] = (
            "[mixed_precision] grad_accumulation_dtype = 'float32'",
            "use grad_accumulation_dtype 'param_dtype'",
        )
    return found


def _composition_conflict(cfg: JobConfig) -> str | None:
    """The first composition of parts `containers.rules` refuses, by its config keys, in one
    line: what conflicts, why, and how to turn off either."""
    features = _features(cfg)
    rule = conflict(features)
    if rule is None:
        return None
    (key_a, fix_a), (key_b, fix_b) = features[rule.a], features[rule.b]
    return f"{key_a} with {key_b}: {rule.reason}; {fix_a} or {fix_b}"


def _fsdp1_conflicts(cfg: JobConfig) -> list[str]:
    """What FSDP1 model parts cannot run with beside the parts' compositions
    (`containers.state.fsdp1` says why in full)."""
    par = cfg.parallelism
    key = "[parallelism] data_parallel_shard_impl = 'fsdp1'"
    fix = "use data_parallel_shard_impl = 'fsdp2'"
    found = []
    for degree in ("tensor_parallel_degree", "pipeline_parallel_degree"):
        if getattr(par, degree) > 1:
            found.append(
                f"{key} with {degree} = {getattr(par, degree)}: FSDP1 parameters are flat "
                f"slices that tensor and pipeline parallelism cannot take; {fix} or set "
                f"{degree} = 1"
            )
    policy = _fsdp_policy_set(cfg.training)
    if policy is not None:
        found.append(
            f"{key} with [training] {policy[0]} = {policy[1]!r}: that is FSDP2's mixed "
            f"precision policy; {fix} or set mixed_precision_param and mixed_precision_reduce "
            "to 'float32'"
        )
    for where, name in _section_and_groups(cfg.optimizer, "name"):
        if name in ("Muon", "Adafactor"):
            found.append(
                f"{key} with {where} = {name!r}: FSDP1 hands the optimizer 1-D slices of each "
                f"matrix, and {name} does not update elementwise; {fix} or pick an elementwise "
                "optimizer (AdamW, Adam, SGD, ...)"
            )
    return found


def _section_and_groups(cfg: OptimizerConfig, key: str) -> list[tuple[str, Any]]:
    """`key` of the `[optimizer]` section and of each param group that sets it, as
    (where it is written, value): `[optimizer] key`, `[optimizer.param_groups[i]] key`."""
    found = [(f"[optimizer] {key}", getattr(cfg, key))]
    for i, group in enumerate(cfg.param_groups):
        if getattr(group, key) is not None:
            found.append((f"[optimizer.param_groups[{i}]] {key}", getattr(group, key)))
    return found


def _fsdp_policy_set(cfg: Training) -> tuple[str, str] | None:
    """The first of `mixed_precision_param` / `_reduce` that asks FSDP2 for a cast, as
    (key, value); None when both are float32 (nothing to apply)."""
    for key in ("mixed_precision_param", "mixed_precision_reduce"):
        if getattr(cfg, key) != "float32":
            return key, getattr(cfg, key)
    return None


def _policy_conflict(cfg: JobConfig) -> str | None:
    found = _fsdp_policy_set(cfg.training)
    if found is None or cfg.optimizer.container != "mixed_precision":
        return None
    key, value = found
    return (
        f"[training] {key} = {value!r}: container 'mixed_precision' keeps its parameters in "
        f"[mixed_precision] param_dtype {cfg.mixed_precision.param_dtype!r} already, and FSDP2 "
        "computes and reduces in that dtype; leave mixed_precision_param and "
        "mixed_precision_reduce at 'float32', or use container 'default' (float32 parameters) "
        "for FSDP2's mixed precision"
    )


def fsdp_mixed_precision(cfg: JobConfig, dp_replicate: int, dp_shard: int) -> None:
    """Raise `ConfigError` when `[training] mixed_precision_param` or `_reduce` asks for FSDP2's
    mixed precision but the resolved data-parallel degrees leave FSDP2 nothing to shard
    (`fully_shard` is applied only when dp_shard or dp_replicate is above 1)."""
    found = _fsdp_policy_set(cfg.training)
    if found is None or dp_shard > 1 or dp_replicate > 1:
        return
    key, value = found
    raise ConfigError(
        f"[training] {key} = {value!r}: FSDP2's mixed precision applies where FSDP2 shards, "
        f"but data_parallel_shard_degree {dp_shard} and data_parallel_replicate_degree "
        f"{dp_replicate} leave nothing to shard; run 2 or more data-parallel ranks, or set "
        "mixed_precision_param and mixed_precision_reduce to 'float32' (container "
        "'mixed_precision' gives bf16 parameters without FSDP2)"
    )


def cross_check(cfg: JobConfig) -> None:
    """Raise `ConfigError` for the first rule `cfg` breaks."""
    ft = cfg.fault_tolerance
    problems = []
    if ft.enable and ft.replica_id >= ft.group_size:
        problems.append(
            f"[fault_tolerance] replica_id = {ft.replica_id}: must be below group_size = "
            f"{ft.group_size}; raise group_size or lower replica_id"
        )
    if ft.enable and ft.min_replica_size > ft.group_size:
        problems.append(
            f"[fault_tolerance] min_replica_size = {ft.min_replica_size}: above group_size = "
            f"{ft.group_size}, the replica groups this job can have, so no step could ever "
            f"commit; use min_replica_size <= {ft.group_size}"
        )
    if ft.semi_sync_method == "diloco" and ft.num_fragments > ft.sync_steps:
        problems.append(
            f"[fault_tolerance] num_fragments = {ft.num_fragments}: more than sync_steps = "
            f"{ft.sync_steps} (each fragment syncs on a step of its own); use at most "
            f"{ft.sync_steps}"
        )
    spacing = ft.sync_steps // ft.num_fragments
    if (
        ft.semi_sync_method == "diloco"
        and ft.num_fragments <= ft.sync_steps
        and (ft.fragment_sync_delay >= spacing)
    ):
        problems.append(
            f"[fault_tolerance] fragment_sync_delay = {ft.fragment_sync_delay}: a fragment's "
            f"average must land before the next fragment's is taken (sync_steps // "
            f"num_fragments = {spacing} steps apart); use at most {spacing - 1}"
        )
    mp = cfg.mixed_precision
    if not mp.min_scale <= mp.initial_scale <= mp.max_scale:
        problems.append(
            f"[mixed_precision] initial_scale = {mp.initial_scale!r}: must lie within "
            f"min_scale = {mp.min_scale!r} and max_scale = {mp.max_scale!r}; adjust one of them"
        )
    if cfg.parallelism.data_parallel_shard_impl == "fsdp1":
        problems += _fsdp1_conflicts(cfg)
    if (composition := _composition_conflict(cfg)) is not None:
        problems.append(composition)
    problems += _unread(cfg)
    if (line := _policy_conflict(cfg)) is not None:
        problems.append(line)
    if cfg.optimizer.container == "fault_tolerant" and not ft.enable:
        problems.append(
            "[optimizer] container = 'fault_tolerant': needs a torchft manager; set "
            "[fault_tolerance] enable = true (then container 'default' is enough)"
        )
    warmup, steps = cfg.lr_scheduler.warmup_steps, cfg.training.steps
    if warmup > steps:
        problems.append(
            f"[lr_scheduler] warmup_steps = {warmup}: more than [training] steps = {steps}, so "
            f"the lr would never reach its peak; use warmup_steps <= {steps} or train longer"
        )
    if problems:
        raise ConfigError(problems[0])


def accumulation_steps(cfg: Training, dp_world_size: int) -> int:
    """Micro-batches per optimizer step on each rank, of `dp_world_size` data-parallel ranks
    (all replica groups' ranks under torchft: the global batch spans them all)."""
    if cfg.global_batch_size < 0:
        return cfg.gradient_accumulation_steps
    per_micro = cfg.local_batch_size * dp_world_size
    accum, rest = divmod(cfg.global_batch_size, per_micro)
    if accum == 0:
        raise ConfigError(
            f"[training] global_batch_size = {cfg.global_batch_size}: expected -1 (derived) or "
            f"a multiple of local_batch_size {cfg.local_batch_size} x {dp_world_size} "
            f"data-parallel ranks, at least {per_micro}"
        )
    if rest:
        raise ConfigError(
            f"[training] global_batch_size = {cfg.global_batch_size}: not a multiple of "
            f"local_batch_size {cfg.local_batch_size} x {dp_world_size} data-parallel ranks; "
            "change either"
        )
    if cfg.gradient_accumulation_steps not in (1, accum):
        raise ConfigError(
            f"[training] gradient_accumulation_steps = {cfg.gradient_accumulation_steps}: "
            f"global_batch_size {cfg.global_batch_size} implies {accum}; set only one of them"
        )
    return accum
