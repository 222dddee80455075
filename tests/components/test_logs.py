"""train.py's logging on 2 real ranks: said once, kept in train.log, known noise filtered."""

from __future__ import annotations

import logging
import warnings

import torch.distributed as dist

from components.logs import setup_logging
from tests.harness.dist import run_ranks

VIEW_WARNING = (
    "FSDP2-wrapped module (FSDPTransformer) returned a view tensor. An in-place op on this "
    "view (e.g., `x += y`) will silently drop the pre-backward hook"
)


def _log_as_train_py(folder: str) -> None:
    rank = dist.get_rank()
    run_log = setup_logging(rank)
    log = logging.getLogger("train")
    log.info("before the folder is this run's")
    run_log.keep_in(folder)
    log.warning("what every rank would say")  # e.g. a seed's "not used" keys
    warnings.warn("a warning of torch that every rank meets", UserWarning, stacklevel=1)
    # As torch's FSDP2 raises it (its module decides whether the filter applies).
    module = "torch.distributed.fsdp._fully_shard._fsdp_state"
    warnings.warn_explicit(VIEW_WARNING, UserWarning, "_fsdp_state.py", 331, module=module)
    log.error("rank %d failed", rank)
    run_log.close()
    log.error("after close: stderr only")


def test_every_rank_s_line_once_errors_of_each_rank_and_known_noise_filtered(tmp_path):
    run_ranks(2, _log_as_train_py, str(tmp_path))
    lines = (tmp_path / "train.log").read_text().splitlines()
    once = ["before the folder is this run's", "what every rank would say", "Warning: a warning"]
    for text in once:
        assert sum(text in line for line in lines) == 1, (text, lines)
    assert any(line.endswith("ERROR rank 0 failed") for line in lines), lines
    assert any(line.endswith("ERROR [rank 1] rank 1 failed") for line in lines), lines
    assert not any("view tensor" in line or "after close" in line for line in lines), lines


def _log_as_a_replica_group(folder: str) -> None:
    rank = dist.get_rank()
    run_log = setup_logging(rank)
    run_log.tag_group(3)
    run_log.keep_in(folder)
    log = logging.getLogger("train")
    log.info("step 1")
    log.error("rank %d failed", rank)
    run_log.close()


def test_a_replica_group_s_lines_carry_its_group_id(tmp_path):
    run_ranks(2, _log_as_a_replica_group, str(tmp_path))
    lines = (tmp_path / "train.log").read_text().splitlines()
    assert any(line.endswith("INFO [group 3] step 1") for line in lines), lines
    assert any(line.endswith("ERROR [group 3] [rank 1] rank 1 failed") for line in lines), lines
