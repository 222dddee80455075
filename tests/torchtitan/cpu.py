"""The smallest shim that runs torchtitan 0.3.0's own Trainer on CPU ranks (gloo, FSDP2), for
tests only: `apply()` before `torchtitan.trainer` is imported, then `debug_config()`.

`apply()` patches process-local names only, each because torchtitan assumes a GPU:
1. `triton` is imported by a module the Trainer imports (MoE kernels a dense llama3 never
   launches): a stub is importable while that module loads, after torch cached "no triton".
2. torchtitan picks `device_type` "cuda" and `torch.cuda` as its device module at import:
   cpu and the few `torch.cuda` calls it makes, answered for a CPU.
3. Its local device is `cpu:0`, which gloo ranks cannot share: `cpu`.
4. FSDP2 reduces gradients with PREMUL_SUM (torchtitan divides by the token count itself),
   which gloo lacks: a plain sum, the same arithmetic.
5. torch 2.13 has no `set_timeout` for `set_pg_timeouts`: a no-op.
6. For the suite's time, not for a CPU: `Trainer.train()` ends with a 2 s sleep on rank 0
   (waiting for the other ranks, which `close()` waits for anyway): no sleep.

Everything else goes through torchtitan's own config: SDPA for FlexAttention (no CPU
backward; each window is one document, so causal SDPA is the same mask), a synthetic
tokenizer and data stream (its tokenizer and c4_test data live outside the wheel).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import time
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer

from containers import torchtitan as oc

_applied: list[bool] = []


class _Anything:
    """Any attribute of the triton stub, at module level: `@triton.jit`, `tl.constexpr`."""

    def __getattr__(self, name: str) -> Any:
        return _Anything()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # a decorator
        return _Anything()


class _Stub(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


class _CpuDevice:
    """The slice of `torch.cuda` torchtitan calls on its device module."""

    set_device = staticmethod(lambda device: None)
    current_device = staticmethod(lambda: 0)
    device_count = staticmethod(lambda: 1)
    synchronize = staticmethod(lambda device=None: None)
    get_device_name = staticmethod(lambda device=None: "cpu")
    reset_peak_memory_stats = staticmethod(lambda device=None: None)
    empty_cache = staticmethod(lambda: None)
    memory_stats = staticmethod(lambda device=None: {})

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(total_memory=memory)


def apply() -> None:
    """Patch torchtitan for CPU ranks (once a process)."""
    if _applied:
        return
    _applied.append(True)
    import torch._dynamo  # (torch probes triton as these import: not found, cached)
    import torch._inductor.runtime.hints
    from torch.utils._triton import has_triton_package

    has_triton_package()
    stubbed = []
    try:
        import triton  # noqa: F401
    except ImportError:
        for name in ("triton", "triton.language"):
            stub = _Stub(name)
            stub.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            stub.__path__ = []
            sys.modules[name] = stub
            stubbed.append(name)
        sys.modules["triton"].language = sys.modules["triton.language"]
    try:
        import torchtitan.distributed.minimal_async_ep
    finally:
        for name in stubbed:
            del sys.modules[name]
    import torch.distributed as dist
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.fsdp as fsdp
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as utils
    import torchtitan.trainer

    for module in (utils, metrics, parallel_dims, dist_utils):
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = _CpuDevice()
    utils.get_local_device = lambda: torch.device("cpu")
    divide = fsdp.disable_fsdp_gradient_division

    def plain_sums(model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        divide(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = plain_sums
    if not hasattr(dist, "set_timeout"):
        dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None
    torchtitan.trainer.time = _NoSleep()


class _NoSleep:
    """The `time` module without `sleep`, for torchtitan's trainer module alone."""

    sleep = staticmethod(lambda seconds: None)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


class Tokenizer(BaseTokenizer):
    """Token ids as their own text: only the vocabulary size matters here."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 2048

    def __init__(self, config: Config, *, tokenizer_path: str | None = None) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        return [int(t) for t in str(text).split()]

    def decode(self, ids: Any, *args: Any, **kwargs: Any) -> str:
        return " ".join(str(int(i)) for i in ids)

    def get_vocab_size(self) -> int:
        return self.vocab_size


class _Markov(IterableDataset):
    """Endless windows of a fixed sparse Markov chain: sample i of DP rank r is a function of
    (seed, r, i) alone, so the stream resumes from one number."""

    def __init__(self, seq_len: int, tokens: int, seed: int, dp_rank: int) -> None:
        self.seq_len, self.tokens, self.seed, self.dp_rank = seq_len, tokens, seed, dp_rank
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randint(tokens, (tokens, 2), generator=g).tolist()
        self.sample = 0

    def __iter__(self) -> Any:
        while True:
            g = torch.Generator().manual_seed(
                (self.seed * 1_000_003 + self.dp_rank) * 1_000_003 + self.sample
            )
            token = int(torch.randint(self.tokens, (1,), generator=g))
            seq = [token]
            for pick in torch.randint(2, (self.seq_len,), generator=g).tolist():
                token = self.table[token][pick]
                seq.append(token)
            self.sample += 1
            t = torch.tensor(seq)
            yield {"input": t[:-1]}, t[1:]

    def state_dict(self) -> dict[str, int]:
        return {"sample": self.sample}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sample = state["sample"]


class DataLoader(ParallelAwareDataloader):
    """torchtitan's checkpointable loader over `_Markov` windows."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "markov"

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: Any,
        seq_len: int,
        local_batch_size: int,
        **kwargs: Any,
    ) -> None:
        stream = _Markov(seq_len, min(256, tokenizer.get_vocab_size()), 0, dp_rank)
        super().__init__(
            stream, dp_rank=dp_rank, dp_world_size=dp_world_size,
            batch_size=local_batch_size, num_workers=0,
        )  # fmt: skip


class _Capture:
    """torchtitan's logger, keeping each logged step's metrics too."""

    def __init__(self, inner: Any, rows: dict[int, dict[str, Any]]) -> None:
        self.inner, self.rows = inner, rows

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.rows[step] = dict(metrics)
        self.inner.log(metrics, step)

    def close(self) -> None:
        self.inner.close()


class Rows(oc.MetricsProcessor):
    """`containers.torchtitan.MetricsProcessor` whose logged metrics a test reads back
    (`rows`: step -> metrics)."""

    @dataclass(kw_only=True, slots=True)
    class Config(oc.MetricsProcessor.Config):
        pass

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.rows: dict[int, dict[str, Any]] = {}
        self.logger = _Capture(self.logger, self.rows)


def debug_config(
    dump_folder: str, steps: int = 20, container: str | None = None, max_norm: float = 1.0
) -> Any:
    """torchtitan's llama3 debug model config for 2 CPU ranks (FSDP2 over both), seeded and
    deterministic, every step's metrics kept (`Rows`); its own AdamW container, or ours of
    the kind `container` over the same param groups."""
    apply()
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    for _, _, parent, attr in config.model_spec.model.traverse(FlexAttention.Config):
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    config.tokenizer = Tokenizer.Config()
    config.dataloader = DataLoader.Config()
    config.hf_assets_path = "."  # (only checked to exist)
    config.dump_folder = dump_folder
    config.metrics = Rows.Config(log_freq=1)
    t = config.training
    t.local_batch_size, t.seq_len, t.steps = 2, 64, steps
    t.mixed_precision_param = "float32"
    t.disable_cuda_graphs = True
    config.parallelism.data_parallel_shard_degree = -1
    config.parallelism.spmd_backend = "partial_dtensor"
    config.optimizer.implementation = "foreach"
    config.activation_checkpoint = None
    config.validator.enable = False
    config.checkpoint.enable = False
    config.debug.seed = 0
    config.debug.deterministic = True
    t.max_norm = max_norm
    if container is not None:
        config.optimizer = oc.OptimizersContainer.Config(
            param_groups=config.optimizer.param_groups,
            implementation=config.optimizer.implementation,
            container=container,
        )
    return config
