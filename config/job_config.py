"""Typed job config: one kw-only dataclass per TOML section.

Section and key names follow torchtitan v0.2's TOML where one exists (torchtitan 0.3.0
configures in Python: docs/torchtitan.md). The defaults are a job that
runs: the debug model on stdlib text for 200 steps (`config/debug.toml` spells it out).
Numeric bounds live in field metadata (see `bounded`) so the loader can name the section, key,
value and fix in its errors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from config.fields import bounded
from config.optimizer_config import Optimizer
from containers.precision.settings import (
    GradAccumulationDtype,
    LossScaling,
    MasterDtype,
    MixedPrecisionSettings,
    ParamDtype,
)

MAX_BATCH = 1 << 20
"""The most sequences a micro-batch, and micro-batches a step (beyond it a batch only exhausts
memory or time before its first step ends)."""
MAX_TIMEOUT_MS = 7 * 24 * 3600 * 1000
"""A week: the longest timeout a torchft wait takes (Python's timedelta and torch's process
groups overflow far beyond it)."""
FloatDtype = Literal["float32", "bfloat16", "float16"]


@dataclass(kw_only=True)
class Job:
    config_file: str | None = None
    """TOML file the rest of the config was read from (set by `--job.config_file`)."""

    dump_folder: str = "./outputs"
    """Folder for checkpoints, metrics and logs of this run (`train.log`, `metrics.jsonl`,
    `config.toml`, `tb/`); one live run at a time (a second one exits 2 naming the holder of
    `run.lock` there)."""

    print_config: bool = False
    """Log the resolved config at start, as the TOML that train.py also saves to
    `config.toml` in the dump folder (which `--job.config_file` reads back)."""


@dataclass(kw_only=True)
class Model:
    name: str = "llama"
    """Train spec to build (see `components.train_spec.get_train_spec`)."""

    flavor: str = "debug"
    """Size preset of the model inside its train spec."""

    num_parts: int = bounded(2, ge=1)
    """Number of model parts (pipeline stages) the model is split into, each keeping its
    parameters' FQNs. Without pipeline parallelism every rank holds all of them; with
    `[parallelism] pipeline_parallel_degree` P each pipeline rank holds num_parts / P
    (one for GPipe and 1F1B, two or more for Interleaved1F1B)."""

    load_balance_coeff: float = bounded(1e-3, ge=0.0)
    """Mixture-of-experts families ("moe"): DeepSeek-V3's aux-loss-free load balancing, how far
    each expert's routing bias moves after a committed step, towards the experts that got
    fewer tokens than the mean (torchtitan's default); 0 keeps the biases at zero (the load is
    still counted and reported). A family without experts accepts only the default."""


PipelineSchedule = Literal["GPipe", "1F1B", "Interleaved1F1B"]
ShardImpl = Literal["fsdp2", "fsdp1"]


@dataclass(kw_only=True)
class Parallelism:
    """How the ranks are arranged: one named mesh (pp, dp_replicate, dp_shard, tp) whose
    degrees multiply to the world size (of one replica group under torchft); expert
    parallelism splits dp_shard into (dp_shard_mod_ep, ep)."""

    data_parallel_replicate_degree: int = bounded(1, ge=1)
    """Data-parallel replicas, each holding a full copy sharded over dp_shard (HSDP when > 1)."""

    data_parallel_shard_degree: int = bounded(-1, ge=-1)
    """Ranks that FSDP2 shards parameters, gradients and optimizer state over; -1 = the ranks
    the other degrees leave."""

    data_parallel_shard_impl: ShardImpl = "fsdp2"
    """Which FSDP shards the model parts over the data-parallel ranks: "fsdp2"
    (`fully_shard`, DTensor parameters) or "fsdp1" (`FullyShardedDataParallel` with
    `use_orig_params=True`; FULL_SHARD, HYBRID_SHARD when data_parallel_replicate_degree > 1).
    Checkpoints are the same flat FQN format either way and move between the two. fsdp1 runs
    without tensor or pipeline parallelism, in-backward steps or torchft, with elementwise
    optimizers only (not Muon or Adafactor)."""

    tensor_parallel_degree: int = bounded(1, ge=1)
    """Ranks that split attention and feed-forward matrices column- and row-wise."""

    pipeline_parallel_degree: int = bounded(1, ge=1)
    """Ranks the model's parts (`[model] num_parts`) are spread over, as pipeline stages."""

    pipeline_parallel_schedule: PipelineSchedule = "1F1B"
    """torch.distributed.pipelining schedule; Interleaved1F1B holds several stages per rank."""

    pipeline_parallel_microbatch_size: int = bounded(1, ge=1)
    """Sequences per pipeline micro-batch; it divides `[training] local_batch_size`, and the
    quotient is the number of micro-batches the schedule runs per batch."""

    expert_parallel_degree: int = bounded(1, ge=1)
    """Ranks a mixture of experts' routed experts are split over (each holds num_experts /
    degree of them; tokens travel to their experts and back by all-to-all), carved out of
    the data_parallel_shard_degree ranks (it divides that degree; the experts are FSDP2-sharded
    over the quotient). 1: every rank holds every expert. Only for families with experts
    ("moe"), without tensor parallelism or fsdp1."""


@dataclass(kw_only=True)
class LRScheduler:
    warmup_steps: int = bounded(10, ge=0)
    """Steps of linear warmup from near zero to the peak lr; at most [training] steps."""

    decay_ratio: float | None = bounded(None, ge=0.0, le=1.0)
    """Fraction of the steps spent decaying (WSD); None decays over all steps after warmup."""

    decay_type: Literal["linear", "sqrt", "cosine"] = "cosine"
    """Shape of the decay."""

    min_lr_factor: float = bounded(0.1, ge=0.0, le=1.0)
    """Lr at the end of the decay, as a fraction of the peak lr."""


@dataclass(kw_only=True)
class Training:
    steps: int = bounded(200, ge=1)
    """Optimizer steps to train for."""

    local_batch_size: int = bounded(8, ge=1, le=MAX_BATCH)
    """Sequences per micro-batch on each data-parallel rank."""

    seq_len: int = bounded(128, ge=1)
    """Tokens per sequence; at most the model flavor's maximum (checked before the job starts)."""

    gradient_accumulation_steps: int = bounded(1, ge=1, le=MAX_BATCH)
    """Micro-batches per optimizer step on each rank (derived when global_batch_size is set)."""

    global_batch_size: int = bounded(-1, ge=-1, le=MAX_BATCH**2)
    """Sequences per optimizer step over all ranks; -1 = local_batch_size x ranks x
    gradient_accumulation_steps. Setting it keeps the batch (and the loss curve) the same when
    a checkpoint resumes at another world size."""

    max_norm: float = bounded(1.0, ge=0.0)
    """Global gradient-norm clip threshold; 0 disables clipping."""

    mixed_precision_param: FloatDtype = "float32"
    """Dtype FSDP2 all-gathers the parameters in and computes forward and backward in (its
    `MixedPrecisionPolicy(param_dtype)`); the sharded parameters, gradients and optimizer state
    stay float32. Needs FSDP2 (data_parallel_shard_degree or data_parallel_replicate_degree
    > 1) and a container that keeps float32 parameters (not "mixed_precision")."""

    mixed_precision_reduce: FloatDtype = "float32"
    """Dtype FSDP2 reduce-scatters (and, with HSDP, all-reduces) the gradients in (its
    `MixedPrecisionPolicy(reduce_dtype)`); same conditions as `mixed_precision_param`."""

    stop_grace_seconds: float = bounded(20.0, gt=0.0, le=3600.0)
    """After a stop signal, the longest the run takes to save and exit (schedulers often
    SIGKILL 30 s after their SIGTERM); past it, it says which checkpoint it could not write
    and exits 1."""

    max_consecutive_skips: int = bounded(10, ge=1)
    """Steps skipped in a row for a non-finite loss or gradients (weights, optimizer state
    and lr schedule left unchanged, the batch spent) before the run stops with exit code 1."""

    seed: int = bounded(0, ge=0, le=2**64 - 1)
    """Seed for model init and data order (torch's range: an unsigned 64-bit number)."""

    dataset: str = "stdlib"
    """Corpus the model family's dataloader reads; the llama family offers "stdlib" (the
    Python sources of the interpreter's standard library, present on every machine)."""


@dataclass(kw_only=True)
class Metrics:
    log_freq: int = bounded(1, ge=1)
    """Log (and write to metrics.jsonl) every this many steps."""

    enable_tensorboard: bool = False
    """Also write TensorBoard scalars to `{dump_folder}/tb` (needs the tensorboard package)."""

    log_param_checksum: bool = False
    """Log the sum of all parameters (float64) each step: replicas that hold the same state
    log the same value. Costs one read of the parameters per step."""


@dataclass(kw_only=True)
class Checkpoint:
    enable: bool = False
    """Save and resume checkpoints."""

    folder: str = "checkpoint"
    """Sub-folder of `job.dump_folder` that holds the `step-N` checkpoints."""

    interval: int = bounded(500, ge=1)
    """Save every this many steps (and at the end)."""

    keep_latest_k: int = bounded(0, ge=0)
    """Keep only the newest k checkpoints; 0 keeps all."""

    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """Save in the background with `dcp.async_save` from a CPU copy taken at the step; each
    save becomes `step-N` as soon as it completes. "async_with_pinned_mem" keeps the CPU copy
    for the run (pinned where CUDA is) and copies into it again at each save: no allocation
    per save, one copy of the state held between saves."""

    load_step: int = bounded(-1, ge=-1)
    """Step to resume from; -1 resumes from the newest complete checkpoint. A step older than
    the newest is refused (the run would overwrite or rotate away the newer ones) unless
    `set_aside_newer` is true."""

    set_aside_newer: bool = False
    """With an older `load_step`: move the newer checkpoints into `aside-<time>/` in the
    checkpoint folder (nothing is deleted) and train on from `load_step`."""

    export_model: bool = False
    """At the end, also write the full model state dict to one file (`model-step-N.pt`)."""

    allow_model_changes: bool = False
    """Resume a checkpoint whose model settings (`step-N/.model.json`: the family, flavor and
    its arguments) differ from this run's: a change that keeps every shape (MoE top_k 2 -> 1)
    loads without an error and trains another model, so it is refused unless this says the
    change is meant."""

    initial_load_path: str = ""
    """A checkpoint folder (one holding `.metadata`: ours or torchtitan's) that seeds the run
    when `folder` holds no checkpoint yet; a checkpoint in `folder` always wins. Empty: none."""

    initial_load_model_only: bool = True
    """With `initial_load_path`: load the model weights only; false also loads optimizer state,
    LR schedule position and step (and, from our own layout, data position and RNG)."""


@dataclass(kw_only=True)
class FaultTolerance:
    enable: bool = False
    """Train as one replica group of a torchft job (selects container "fault_tolerant")."""

    replica_id: int = bounded(0, ge=0)
    """Index of this replica group, in [0, group_size)."""

    group_size: int = bounded(1, ge=1, le=65536)
    """Number of replica groups the job runs (each reads its own share of the data)."""

    min_replica_size: int = bounded(1, ge=1)
    """Fewest replica groups that may commit a step."""

    lighthouse: str = ""
    """Lighthouse address (`http://host:port`); empty reads `TORCHFT_LIGHTHOUSE`."""

    manager_port: int = bounded(-1, ge=-1, le=65535)
    """Port of this replica group's torchft manager; -1 = 29600 + replica_id, 0 = any free
    port (peers find a group by the address it reports to the lighthouse, so a restarted group
    may take another port)."""

    process_group: Literal["gloo", "nccl"] = "gloo"
    """Process group across replica groups."""

    process_group_timeout_ms: int = bounded(10_000, ge=1, le=MAX_TIMEOUT_MS)
    """Timeout of collectives and commits across replica groups."""

    quorum_timeout_ms: int = bounded(60_000, ge=1, le=MAX_TIMEOUT_MS)
    """Longest wait for a quorum of replica groups, a lighthouse that went away and came
    back included; past it the group saves its last committed step and exits 1 in one line."""

    connect_timeout_ms: int = bounded(10_000, ge=1, le=MAX_TIMEOUT_MS)
    """Longest wait to reach the lighthouse at start-up (past it: one line, exit 2) and to
    reach a peer's manager when healing."""

    uncommitted_timeout_ms: int = bounded(600_000, ge=1, le=MAX_TIMEOUT_MS)
    """Longest a replica group retries steps that do not commit (too few replica groups in
    its quorums); past it the group says so, saves its last committed step and exits 1."""

    semi_sync_method: Literal["none", "diloco"] = "none"
    """How replica groups meet: "none" averages gradients every step; "diloco" lets each
    group take `sync_steps` inner steps alone, then averages their pseudo-gradients (global -
    local weights) and takes one outer optimizer step on the global weights (torchtitan's
    name). The outer state (global weights, outer momentum, inner steps done) is checkpointed."""

    sync_steps: int = bounded(100, ge=1)
    """DiLoCo: inner steps between two outer steps (communication falls by this factor)."""

    num_fragments: int = bounded(1, ge=1)
    """DiLoCo: the parameters cut into this many fragments of about equal size, synced in
    turn `sync_steps / num_fragments` steps apart (streaming DiLoCo: each sync moves a
    fragment's bytes); at most `sync_steps`."""

    fragment_sync_delay: int = bounded(0, ge=0)
    """DiLoCo: inner steps between a fragment's average (its pseudo-gradients taken then) and
    its outer step, which lands on the local weights of that later step, mixed by
    `fragment_update_alpha`; the all-reduce overlaps those steps (streaming DiLoCo's tau);
    below `sync_steps / num_fragments`."""

    fragment_update_alpha: float = bounded(0.0, ge=0.0, le=1.0)
    """DiLoCo: after a sync, local = alpha x local + (1 - alpha) x global (0: the global)."""

    outer_optimizer: str = "SGD"
    """DiLoCo: the outer optimizer (a registered `[optimizer] name` that takes every
    parameter, 1-D ones too: not Muon)."""

    outer_lr: float = bounded(0.7, gt=0.0)
    """DiLoCo: the outer learning rate (torchtitan's 0.7)."""

    outer_momentum: float = bounded(0.9, ge=0.0, lt=1.0)
    """DiLoCo: the outer momentum (torchtitan's 0.9)."""

    outer_nesterov: bool = True
    """DiLoCo: Nesterov momentum in the outer step (torchtitan's choice)."""


DILOCO_KEYS = (
    "sync_steps", "num_fragments", "fragment_sync_delay", "fragment_update_alpha",
    "outer_optimizer", "outer_lr", "outer_momentum", "outer_nesterov",
)  # fmt: skip
"""The `[fault_tolerance]` keys only DiLoCo reads (`semi_sync_method = "diloco"`): its math,
which replica groups must share."""


_MP = MixedPrecisionSettings()  # the library's defaults


@dataclass(kw_only=True)
class MixedPrecision:
    """The mixed-precision container's settings (`[optimizer] container = "mixed_precision"`;
    another container refuses a key set here, which it would not read). The defaults are the
    library's (`containers.MixedPrecisionSettings`), which `settings()` makes of this
    section."""

    param_dtype: ParamDtype = _MP.param_dtype
    """Dtype the model parameters are kept in."""

    master_dtype: MasterDtype = _MP.master_dtype
    """Dtype of the master weights the optimizer steps on."""

    loss_scaling: LossScaling = _MP.loss_scaling
    """Loss scaling: "dynamic" adapts to overflows, "static" keeps `initial_scale`; "auto" is
    "dynamic" for float16 and "none" for bfloat16 (fp32's exponent range: no scale needed)."""

    initial_scale: float = bounded(_MP.initial_scale, gt=0.0)
    """Loss scale at the start."""

    growth_factor: float = bounded(_MP.growth_factor, gt=1.0)
    """Scale multiplier after `growth_interval` steps without overflow."""

    backoff_factor: float = bounded(_MP.backoff_factor, gt=0.0, lt=1.0)
    """Scale multiplier after an overflow."""

    growth_interval: int = bounded(_MP.growth_interval, ge=1, le=10**9)
    """Overflow-free steps before the scale grows."""

    hysteresis: int = bounded(_MP.hysteresis, ge=1, le=10**9)
    """Overflows tolerated before the scale backs off."""

    min_scale: float = bounded(_MP.min_scale, gt=0.0)
    """Lowest loss scale."""

    max_scale: float = bounded(_MP.max_scale, gt=0.0)
    """Highest loss scale."""

    store_param_remainders: bool = _MP.store_param_remainders
    """Keep each fp32 master as its bf16 parameter plus a 16-bit remainder (Megatron's name):
    the same master bit for bit in 2 bytes/param instead of 4. bfloat16 parameters and fused
    Adam/AdamW only (with `[optimizer] moment_dtype = "bfloat16"`: 8 bytes/param of state in
    all); checkpoints hold the fp32 masters either way, so runs with and without it load each
    other's. The parameter rounds ties away from zero (torch's cast: to even)."""

    grad_accumulation_dtype: GradAccumulationDtype = _MP.grad_accumulation_dtype
    """Dtype the gradients are summed in over a step's micro-batches: "param_dtype" adds each
    micro-batch's into the last in bf16/fp16 (least memory); "float32" keeps an fp32 sum per
    parameter (+2 bytes/param until the step; with 4 micro-batches on the debug job, 3% lower
    loss than bf16 sums). Not with early_step_in_backward or [fault_tolerance]; the sums step
    eagerly even in a `compiled` group."""

    def settings(self) -> MixedPrecisionSettings:
        """The library's settings of this section (the one conversion: the library never reads
        the trainer's config)."""
        names = [f.name for f in dataclasses.fields(MixedPrecisionSettings)]
        return MixedPrecisionSettings(**{name: getattr(self, name) for name in names})


@dataclass(kw_only=True)
class EMA:
    enable: bool = False
    """Keep an exponential moving average of the weights as optimizer-container state
    (`ema.<fqn>`, of the fp32 masters under mixed precision), updated in the step; checkpointed
    and resharded like the optimizer state."""

    decay: float = bounded(0.9999, ge=0.0, lt=1.0)
    """Weight of the average against the weights at each update: ema = decay x ema +
    (1 - decay) x weights."""

    half_life: float = bounded(0.0, ge=0.0)
    """Steps after which a weight's share of the average has halved; set (> 0) it replaces
    `decay`: decay = 0.5 ** (update_every_n_steps / half_life)."""

    update_every_n_steps: int = bounded(1, ge=1)
    """Update the average at every n-th applied step (from `start_step`)."""

    start_step: int = bounded(0, ge=0)
    """Applied steps during which the average is the weights themselves (it starts then)."""

    eval_every: int = bounded(0, ge=0)
    """Log a held-out loss with the averaged weights (`ema_eval_loss`) beside the trained
    weights' (`eval_loss`) every this many steps; 0: never."""

    export: bool = False
    """`[checkpoint] export_model` writes the averaged weights instead of the trained ones."""


@dataclass(kw_only=True)
class Comm:
    init_timeout_seconds: int = bounded(300, ge=1, le=MAX_TIMEOUT_MS // 1000)
    """Longest wait of a collective until the first step is done (process-group start,
    sharding, checkpoint load, the first step's own collectives)."""

    train_timeout_seconds: int = bounded(100, ge=1, le=MAX_TIMEOUT_MS // 1000)
    """Longest wait of a collective after the first applied step: a rank that stops answering
    ends the run after this long with one line naming the collective."""

    trace_buf_size: int = bounded(20_000, ge=0, le=1_000_000)
    """Collectives torch's flight recorder keeps per process group (`TORCH_FR_BUFFER_SIZE`,
    unless set in the environment); the line of a timed-out run names the last one. 0: off."""


@dataclass(kw_only=True)
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    parallelism: Parallelism = field(default_factory=Parallelism)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    mixed_precision: MixedPrecision = field(default_factory=MixedPrecision)
    comm: Comm = field(default_factory=Comm)
    ema: EMA = field(default_factory=EMA)
