"""Per-step training metrics: a log line, `metrics.jsonl` and optional TensorBoard (rank 0)."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import resource
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from config import Metrics as MetricsConfig
from config import Optimizer as OptimizerConfig
from containers import OptimizersContainer

__all__ = [
    "MetricsLogger",
    "group_lrs",
    "lr_group_names",
    "memory_gib",
    "param_checksum",
    "peak_memory_gib",
]

logger = logging.getLogger(__name__)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated accelerator memory, or the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)  # bytes on macOS, KiB on Linux


def memory_gib(device: torch.device) -> float:
    """Accelerator memory allocated now, or the process's resident set now on CPU: after a
    step, the steady state (parameters, optimizer state, the run's fixed costs)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**30
    try:
        with open("/proc/self/statm") as f:  # Linux
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:  # no /proc: the peak stands in
        return peak_memory_gib(device)


@torch.no_grad()
def param_checksum(params: list[torch.Tensor]) -> float:
    """Sum of all parameters in float64, over the shards of every rank of the mesh."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    total = torch.stack([t.double().sum() for t in local]).sum()
    if any(isinstance(p, DTensor) for p in params):
        dist.all_reduce(total)
    return total.item()


def lr_group_names(optimizers: OptimizersContainer, cfg: OptimizerConfig) -> list[str]:
    """A name for each of `optimizers.param_groups`, from the config rule that formed it:
    `<optimizer>-default` for parameters that match no `[[optimizer.param_groups]]` table,
    `<optimizer>-group<i>` for the i-th table (from 0), e.g. "AdamW-default", "Muon-group0".
    Each part's inner optimizers have groups of the same names (and lrs)."""
    patterns = [re.compile(g.pattern) for g in cfg.param_groups]
    names = []
    for group in optimizers.param_groups:
        fqn = optimizers.fqn_of(group["params"][0])
        hit = next((i for i, rx in enumerate(patterns) if rx.search(fqn)), None)
        if hit is None:
            names.append(f"{cfg.name}-default")
        else:
            names.append(f"{cfg.param_groups[hit].name or cfg.name}-group{hit}")
    return names


def group_lrs(optimizers: OptimizersContainer, names: list[str]) -> dict[str, float]:
    """Each named group's current lr, the default group's first (the log line shows it)."""
    lrs = {}
    for name, group in zip(names, optimizers.param_groups, strict=True):
        lrs.setdefault(name, float(group["lr"]))
    default = next((n for n in lrs if n.endswith("-default")), None)
    return {default: lrs.pop(default), **lrs} if default is not None else lrs


def _strict_json(record: dict[str, Any]) -> str:
    # NaN and inf are not JSON; readers of a step whose loss blew up get null instead.
    finite = {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
    }
    return json.dumps(finite, allow_nan=False)


def _shown(key: str, value: Any) -> str:
    """`value` as the log line shows it: 4 significant digits, "-" for none."""
    if value is None:  # (a healed group's loss: the row's note says why)
        return "-"
    # (checksums are compared across runs and groups: every digit)
    return f"{value:.4g}" if isinstance(value, float) and key != "param_checksum" else f"{value}"


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


def _keep_aside(path: Path) -> None:
    """Rename an earlier run's `path` to `metrics.before-<its last write, UTC>.jsonl`, so a
    run that starts from step 0 neither appends to it nor drops its rows."""
    if not path.exists() or not path.stat().st_size:
        return
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(path.stat().st_mtime))
    kept, n = path.with_name(f"metrics.before-{stamp}.jsonl"), 1
    while kept.exists():
        n += 1
        kept = path.with_name(f"metrics.before-{stamp}-{n}.jsonl")
    os.replace(path, kept)
    logger.info("kept the earlier run's %s as %s (this run starts from step 0)", path, kept.name)


class MetricsLogger:
    """Logs the first step, every `[metrics] log_freq`-th and the last; only if `enabled`.

    `metrics.jsonl` is appended to, so a resumed run continues the same file, once the rows of
    the steps it trains again (its first step and later) are dropped: no step is there twice. A
    run that starts from step 0 keeps an earlier run's file aside (`_keep_aside`). Each
    line is one strict JSON object (non-finite numbers as null) with at least `step`, `time`
    (wall clock, unix seconds) and `loss`. Throughput and step time are over the log window:
    the steps since the last logged row.

    Args:
        cfg: the `[metrics]` section.
        folder: where `metrics.jsonl` (and `tb/`) go.
        total_steps: the run's last step (`[training] steps`), always logged; sets the ETA.
        enabled: whether this process writes (usually rank 0 only).
        device: whose peak memory is reported.
    """

    def __init__(
        self,
        cfg: MetricsConfig,
        folder: str,
        *,
        total_steps: int,
        enabled: bool,
        device: torch.device,
    ) -> None:
        self.enabled = enabled
        self.freq = cfg.log_freq
        self.total_steps = total_steps
        self.device = device
        self._step_times: list[float] = []
        self._window = [0.0, 0, 0]  # seconds, tokens, steps since the last logged row
        self._file = None
        self._tb = None
        if not enabled:
            return
        Path(folder).mkdir(parents=True, exist_ok=True)
        self._path = Path(folder) / "metrics.jsonl"
        if cfg.enable_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                logger.warning(
                    "[metrics] enable_tensorboard: tensorboard is not installed (pip install "
                    "tensorboard, or the README's install command); writing metrics.jsonl only"
                )
            else:
                self._tb = SummaryWriter(str(Path(folder) / "tb"), flush_secs=10)

    def log(
        self,
        step: int,
        loss: float | None,
        step_time: float,
        tokens: int,
        *,
        lrs: Mapping[str, float] | None = None,
        note: str | None = None,
        **extra: Any,
    ) -> None:
        """Record one optimizer step (`tokens` counted over all ranks); `lrs` by group name,
        the first shown in the log line. `loss` None: the step has no loss of its own
        (null in the row), `note` says why (a `note` field, last in the log line)."""
        self._step_times.append(step_time)
        if self.enabled and self._file is None:
            # The first step this run trains: from step 0, an earlier run's rows are kept
            # aside; on a resume, those of this step and later were rolled back and go. Known
            # only now: a torchft group that heals from a peer starts at the peer's step.
            if step == 1:
                _keep_aside(self._path)
            else:
                _drop_rows_after(self._path, step - 1)
            self._file = self._path.open("a", encoding="utf-8")
        window = self._window
        window[0] += step_time
        window[1] += tokens
        window[2] += 1
        if not self.enabled or (step % self.freq and step not in (1, self.total_steps)):
            return
        recent = self._step_times[-20:]
        seconds, tokens_in_window, steps = window
        self._window = [0.0, 0, 0]
        named = {f"lr/{name}": lr for name, lr in (lrs or {}).items()}
        now = memory_gib(self.device)
        record = {
            "step": step,
            "time": round(time.time(), 3),
            "loss": loss,
            **({"lr": next(iter(lrs.values()))} if lrs else {}),
            **extra,
            "tokens_per_s": tokens_in_window / seconds,
            "step_time_s": seconds / steps,
            "memory_gib": now,
            "peak_memory_gib": max(now, peak_memory_gib(self.device)),  # (a lazily kept peak)
            "eta_s": sum(recent) / len(recent) * (self.total_steps - step),
            **named,
            **({"note": note} if note else {}),
        }
        self._write_line(step, record, lr_label=next(iter(lrs), None) if lrs else None)
        self._file.write(_strict_json(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key not in ("step", "time") and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step, walltime=record["time"])

    @staticmethod
    def _write_line(step: int, record: dict[str, Any], lr_label: str | None) -> None:
        fields = "  ".join(
            f"{f'lr[{lr_label}]' if k == 'lr' and lr_label else k} {_shown(k, v)}"
            for k, v in record.items()
            if k not in ("step", "time", "note") and not k.startswith("lr/")
        )
        note = f"  ({record['note']})" if "note" in record else ""
        logger.info("step %5d  %s%s", step, fields, note)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
