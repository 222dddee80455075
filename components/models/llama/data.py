"""Byte-level language-modelling data over text present on every machine: Python's own stdlib.

The corpus is cut into fixed windows whose order is a seeded permutation per epoch. Position is
one global sample counter, the same on every data-parallel rank, so a checkpoint resumes at the
same place whatever the number of ranks.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from config import ConfigError

__all__ = ["ByteTextLoader", "load_corpus"]

_CORPUS_BYTES = 8 * 2**20


def _cache_path(limit: int) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return (
        base
        / "optimizer-containers"
        / f"stdlib-{sys.version_info[0]}.{sys.version_info[1]}-{limit}.bin"
    )


@functools.cache
def load_corpus(limit: int = _CORPUS_BYTES) -> torch.Tensor:
    """The first `limit` bytes of the stdlib's `.py` files, in sorted path order, as uint8.

    Walking the stdlib takes seconds, so the bytes are cached on disk (every process of every
    run reads the same corpus); a cache that cannot be written is simply skipped.
    """
    cache = _cache_path(limit)
    try:
        return torch.frombuffer(bytearray(cache.read_bytes()), dtype=torch.uint8)
    except OSError:
        pass
    corpus = _build_corpus(limit)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(corpus)
        os.replace(tmp, cache)  # atomic: concurrent ranks never read a half-written cache
    except OSError:
        pass
    return torch.frombuffer(bytearray(corpus), dtype=torch.uint8)


def _build_corpus(limit: int) -> bytes:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    if size == 0:
        raise RuntimeError(f"no Python sources found under {root}; cannot build the corpus")
    return b"".join(chunks)[:limit]


class ByteTextLoader:
    """Yields `(inputs, labels)` micro-batches of byte ids for one data-parallel rank.

    Args:
        seq_len: tokens per sequence.
        local_batch_size: sequences per micro-batch on this rank.
        dp_rank: this rank's index among the data-parallel ranks.
        dp_world_size: number of data-parallel ranks.
        seed: seed of the window order.
        corpus: the bytes (uint8) to cut into windows; None: `load_corpus()`.
    """

    def __init__(
        self,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_world_size: int,
        seed: int,
        corpus: torch.Tensor | None = None,
    ) -> None:
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(
                f"dp_rank = {dp_rank}: must lie in [0, dp_world_size = {dp_world_size})"
            )
        self.corpus = load_corpus() if corpus is None else corpus
        self.windows = (len(self.corpus) - 1) // seq_len
        if self.windows < 1:
            raise ValueError(
                f"[training] seq_len = {seq_len}: longer than the {len(self.corpus)}-byte "
                "corpus; use a shorter seq_len"
            )
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.seed = seed
        self.sample_index = 0
        self._order: tuple[int, torch.Tensor] | None = None

    def _window(self, sample: int) -> int:
        epoch, offset = divmod(sample, self.windows)
        if self._order is None or self._order[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(self.windows, generator=g))
        return int(self._order[1][offset])

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.sample_index + self.dp_rank * self.local_batch_size
        rows = []
        for sample in range(first, first + self.local_batch_size):
            start = self._window(sample) * self.seq_len
            rows.append(self.corpus[start : start + self.seq_len + 1])
        self.sample_index += self.local_batch_size * self.dp_world_size
        batch = torch.stack(rows).long()
        return batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"sample_index": self.sample_index, "seed": self.seed, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"sample_index", "seed", "seq_len"} - state.keys()
        if missing:
            raise ValueError(f"data checkpoint lacks {sorted(missing)}; it is not this loader's")
        for key in ("seed", "seq_len"):
            if state[key] != getattr(self, key):
                # The data position means other samples under another seed or seq_len.
                raise ConfigError(
                    f"[training] {key} = {getattr(self, key)!r}: the checkpoint was trained "
                    f"with {key} = {state[key]!r}, and its data position holds only for that; "
                    f"resume with --training.{key} {state[key]!r}, or start a new dump folder"
                )
        self.sample_index = int(state["sample_index"])
