"""train.py's logging: said once, by rank 0; kept in `{dump_folder}/train.log`; known noise off.

- Rank 0 logs INFO and up; the other ranks log errors only. What every rank would say (a
  warning about the shared config, torch's warnings, which `logging.captureWarnings` routes
  through the `py.warnings` logger) is then said once; what goes wrong on one rank is an
  error and is still said by that rank.
- `RunLog.keep_in(folder)` writes the same lines to `train.log` there (other ranks' errors
  too, tagged with their rank), including those logged before the folder was this run's
  (held in memory until then, so a run refused a folder writes nothing into it).
- `quiet_known_noise` filters, at their source, warnings of torch and torchft that are
  harmless on this stack (the README says why, one sentence each), and shortens torchft's
  traceback when a peer replica group dies to one line.
"""

from __future__ import annotations

import logging
import re
import sys
import traceback
import warnings
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from components.job import Job

__all__ = ["FORMAT", "RunLog", "quiet_known_noise", "setup_logging", "start_line"]

FORMAT = "%(asctime)s %(levelname)s %(message)s"

LOG_FILE = "train.log"

# torch and torchft warnings that are harmless here: (message regex, module regex). Each has
# its sentence in the README ("Watching a run").
_HARMLESS_WARNINGS = [
    # Under tensor parallelism the replicated output head returns DTensor.to_local() of its
    # logits: a view of a fresh tensor that the next part and the loss only read.
    (r"FSDP2-wrapped module \(\w+\) returned a view tensor", r"torch\.distributed\.fsdp"),
    # torchft receives a healing peer's state as immutable bytes that nothing else holds.
    (r"The given buffer is not writable", r"torch\.distributed\._serialization"),
    # A torchft replica group of one process saves its checkpoint without a process group.
    (r"torch\.distributed is disabled, unavailable or uninitialized", r"torch\.distributed"),
]


class _TorchftNoise(logging.Filter):
    """torchft's manager: no "cannot reset the NCCL flight recorder" line on a CPU (there is
    no NCCL recorder to reset), and one line, not a traceback, for a failed step's work."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "Unable to reset NCCL flight recorder" in message:
            return False
        if "got exception waiting for work" in message and record.exc_info:
            # gloo's source-file prefix and its advice add nothing to "Connection reset".
            short = re.sub(r"\[[^\]]*\.cc:\d+\] ", "", message).split(". This is", 1)[0]
            where, _, error = short.partition(" got exception waiting for work ")
            record.msg = f"torchft {where}: a peer replica group failed mid-step ({error})"
            record.args = ()
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info, record.exc_text = None, None
        return True


def quiet_known_noise() -> None:
    """Filter the known harmless warnings of torch and torchft (see the module docstring)."""
    for message, module in _HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)
    torchft = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _TorchftNoise) for f in torchft.filters):
        torchft.addFilter(_TorchftNoise())


class _Pending(logging.Handler):
    """Holds records until the run's folder is known (then `RunLog.keep_in` writes them)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class _LogFile(logging.FileHandler):
    """train.log: a write that fails (a full disk) stops the file, with one line on stderr,
    instead of a "--- Logging error ---" dump per line; the console keeps every line."""

    def handleError(self, record: logging.LogRecord) -> None:
        if self.stream is not None and not getattr(self, "_failed", False):
            self._failed = True
            sys.stderr.write(f"train.log: not written from here on ({sys.exc_info()[1]})\n")
        self.setLevel(logging.CRITICAL + 1)


class RunLog:
    """The logging of one train.py process (see the module docstring); from `setup_logging`."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.group = ""  # "[group N] " under torchft (`tag_group`)
        self.level = logging.INFO if rank == 0 else logging.ERROR
        self.file: logging.FileHandler | None = None
        self._pending: _Pending | None = _Pending()
        root = logging.getLogger()
        self._root_level = root.level
        root.setLevel(self.level)
        root.addHandler(self._pending)
        logging.captureWarnings(True)
        self._excepthook = sys.excepthook
        sys.excepthook = self._uncaught

    def keep_in(self, folder: str) -> Path:
        """Append this process's lines to `folder/train.log` from now on, starting with the
        ones logged so far; returns the file's path."""
        path = Path(folder) / LOG_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = _LogFile(path, encoding="utf-8")
        tag = "" if self.rank == 0 else f"[rank {self.rank}] "
        self.file.setFormatter(self._formatter(tag))
        root = logging.getLogger()
        root.addHandler(self.file)
        if self._pending is not None:
            root.removeHandler(self._pending)
            for record in self._pending.records:
                self.file.handle(record)
            self._pending = None
        return path

    def tag_group(self, replica_id: int) -> None:
        """Start every line of this process with `[group N]` (torchft: replica groups run
        side by side, and their lines must be told apart)."""
        self.group = f"[group {replica_id}] "
        self._restyle_console()
        if self.file is not None:
            self.file.setFormatter(
                self._formatter("" if self.rank == 0 else f"[rank {self.rank}] ")
            )

    def _restyle_console(self) -> None:
        for handler in logging.getLogger().handlers:
            if not isinstance(handler, _Pending | _LogFile):
                handler.setFormatter(self._formatter())

    def _formatter(self, tag: str = "") -> logging.Formatter:
        return logging.Formatter(FORMAT.replace("%(message)s", f"{self.group}{tag}%(message)s"))

    def _uncaught(
        self, kind: type[BaseException], error: BaseException, tb: TracebackType | None
    ) -> None:
        """A traceback that ends the process goes to `train.log` too (it is any rank's error)."""
        if self.file is not None and not issubclass(kind, KeyboardInterrupt):
            text = "".join(traceback.format_exception(kind, error, tb)).rstrip()
            self.file.handle(
                logging.makeLogRecord({"msg": text, "levelno": 40, "levelname": "ERROR"})
            )
        self._excepthook(kind, error, tb)

    def close(self) -> None:
        """Stop writing to the folder and undo the rest of `setup_logging` (but the filters
        of known noise), for a process that goes on after the run."""
        root = logging.getLogger()
        root.setLevel(self._root_level)
        if self.group:
            self.group = ""
            self._restyle_console()
        logging.captureWarnings(False)
        if self._pending is not None:
            root.removeHandler(self._pending)
            self._pending = None
        if self.file is not None:
            root.removeHandler(self.file)
            self.file.close()
            self.file = None
        sys.excepthook = self._excepthook


def setup_logging(rank: int) -> RunLog:
    """Set up train.py's logging for the process of `rank` (see the module docstring)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(format=FORMAT)
    quiet_known_noise()
    return RunLog(rank)


def start_line(job: Job, step: int) -> str:
    """What the run is, in one line: model, parts and the stages of each rank, ranks,
    container, micro-batches per optimizer step (pipeline micro-batches counted) and the step
    it starts from."""
    cfg, pp = job.cfg, job.dims.pp
    pipeline_micro = cfg.parallelism.pipeline_parallel_microbatch_size
    parts = f"{cfg.model.num_parts} parts"
    micro = job.accumulation_steps
    batches = ""
    if pp > 1:
        stages = len(job.model_parts)
        schedule = cfg.parallelism.pipeline_parallel_schedule
        parts += f", {stages} stage{'s' if stages > 1 else ''} per rank (pp {pp}, {schedule}),"
        pipelined = cfg.training.local_batch_size // pipeline_micro
        batches = f" ({micro} x {pipelined} pipeline micro-batches)"
        micro *= pipelined
    ranks = f"{job.world_size} {job.device.type} ranks"
    if job.dims.ep > 1:
        ranks += f" (experts split over ep {job.dims.ep})"
    return (
        f"{cfg.model.name} {cfg.model.flavor}: {job.n_params / 1e6:.2f}M params in {parts} on "
        f"{ranks}, {job.optimizers!r}, "
        f"{micro} micro-batches/step{batches}, from step {step}"
    )
