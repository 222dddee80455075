"""Per-step training metrics: a log line, `metrics.jsonl` and optional TensorBoard (rank 0)."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from config import Metrics as MetricsConfig

__all__ = ["MetricsLogger", "param_checksum", "peak_memory_gib"]

logger = logging.getLogger(__name__)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated accelerator memory, or the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)  # bytes on macOS, KiB on Linux


@torch.no_grad()
def param_checksum(params: list[torch.Tensor]) -> float:
    """Sum of all parameters in float64, over the shards of every rank of the mesh."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    total = torch.stack([t.double().sum() for t in local]).sum()
    if any(isinstance(p, DTensor) for p in params):
        dist.all_reduce(total)
    return total.item()


def _strict_json(record: dict[str, Any]) -> str:
    # NaN and inf are not JSON; readers of a step whose loss blew up get null instead.
    finite = {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
    }
    return json.dumps(finite, allow_nan=False)


def _row_step(line: str) -> int | None:
    """The step of a `metrics.jsonl` row; None for a line cut short by a kill."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _drop_rows_after(path: Path, step: int) -> None:
    """Rewrite `path` without the rows after `step` (atomically: a kill keeps the old file)."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if (s := _row_step(line)) is not None and s <= step]
    if len(kept) == len(lines):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)
    logger.info(
        "dropped %d rows after step %d from %s: this run trains those steps again",
        len(lines) - len(kept),
        step,
        path,
    )


class MetricsLogger:
    """Logs the first step, every `[metrics] log_freq`-th and the last; only if `enabled`.

    `metrics.jsonl` is appended to, so a resumed run continues the same file, once the rows of
    the steps it trains again (after `resumed_from`) are dropped: no step is there twice. Each
    line is one strict JSON object (non-finite numbers as null) with at least `step` and `loss`.

    Args:
        cfg: the `[metrics]` section.
        folder: where `metrics.jsonl` (and `tb/`) go.
        total_steps: the run's last step (`[training] steps`), always logged; sets the ETA.
        enabled: whether this process writes (usually rank 0 only).
        device: whose peak memory is reported.
        resumed_from: the step the run starts after (0: from scratch); None keeps every row.
    """

    def __init__(
        self,
        cfg: MetricsConfig,
        folder: str,
        *,
        total_steps: int,
        enabled: bool,
        device: torch.device,
        resumed_from: int | None = None,
    ) -> None:
        self.enabled = enabled
        self.freq = cfg.log_freq
        self.total_steps = total_steps
        self.device = device
        self._step_times: list[float] = []
        self._file = None
        self._tb = None
        if not enabled:
            return
        Path(folder).mkdir(parents=True, exist_ok=True)
        if resumed_from is not None:
            _drop_rows_after(Path(folder) / "metrics.jsonl", resumed_from)
        self._file = (Path(folder) / "metrics.jsonl").open("a", encoding="utf-8")
        if cfg.enable_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                logger.warning("[metrics] enable_tensorboard: tensorboard is not installed")
            else:
                self._tb = SummaryWriter(str(Path(folder) / "tb"))

    def log(self, step: int, loss: float, step_time: float, tokens: int, **extra: Any) -> None:
        """Record one optimizer step (`tokens` counted over all ranks)."""
        self._step_times.append(step_time)
        if not self.enabled or (step % self.freq and step not in (1, self.total_steps)):
            return
        recent = self._step_times[-20:]
        avg = sum(recent) / len(recent)
        record = {
            "step": step,
            "loss": loss,
            **extra,
            "tokens_per_s": tokens / step_time,
            "step_time_s": step_time,
            "peak_memory_gib": peak_memory_gib(self.device),
            "eta_s": avg * (self.total_steps - step),
        }
        fields = "  ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
            for k, v in record.items()
            if k not in ("step",)
        )
        logger.info("step %5d  %s", step, fields)
        self._file.write(_strict_json(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
