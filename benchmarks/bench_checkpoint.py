"""DCP checkpoint throughput of the optimizer state beside the disk's own write speed.

    .venv/bin/python benchmarks/bench_checkpoint.py [--params 32e6] [--ranks 2] [--quick]

One table, measured in one run: the disk's sequential write speed (fsync'd), DCP save and load
throughput of an OptimizersContainer's AdamW state (plus the model) on FSDP2 gloo ranks, the
load of a checkpoint saved at another world size (resharded) against one saved at the same,
and what the checkpoint manager's checksums add: recorded after a synchronous save (each rank
hashes the files it wrote, rank 0 writes the record), verified by the ranks (a share of the
files each) before the load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table
from components.checkpoint import ModelWrapper
from components.checkpoint.files import verify, write_checksums
from containers import OptimizersContainer
from tests.harness.dist import run_ranks

SAVES = 3  # each save and load is timed this many times, the best kept


def disk_write_gbps(folder: Path, nbytes: int) -> float:
    """Sequential write of `nbytes` in 8 MiB chunks, fsync'd, in GB/s (best of 3)."""
    chunk = os.urandom(8 * 2**20)
    best = float("inf")
    for i in range(SAVES):
        path = folder / f"disk-{i}.bin"
        start = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(nbytes // len(chunk)):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        best = min(best, time.perf_counter() - start)
        path.unlink()
    return nbytes / best / 1e9


def _model(n_params: int) -> nn.Module:
    width = 2048
    rows = max(1, n_params // (width * 8))
    # 8 blocks with an odd row count so shards are uneven across 3 ranks.
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, rows + 1, bias=False) for _ in range(8)))


def _job(n_params: int) -> tuple[nn.Module, OptimizersContainer]:
    model = _model(n_params)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, OptimizersContainer([model], torch.optim.AdamW, {"lr": 1e-3, "fused": True})


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _save(n_params: int, path: str) -> dict[str, float]:
    model, optimizers = _job(n_params)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizers.step()  # real AdamW state: exp_avg, exp_avg_sq, step
    optim_bytes = sum(
        v.to_local().nbytes if hasattr(v, "to_local") else 0
        for v in optimizers.state_dict().values()
    )
    model_bytes = sum(p.to_local().nbytes for p in model.parameters())
    total = torch.tensor([float(optim_bytes + model_bytes)])
    dist.all_reduce(total)
    states = {"model": ModelWrapper([model]), "optimizer": optimizers}
    seconds = float("inf")
    for _ in range(SAVES):  # best of, as the disk's write: one save is at the disk's whim
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
        seconds = min(seconds, _timed(lambda: dcp.save(states, checkpoint_id=path)))
    sums = _timed(lambda: write_checksums(Path(path), shared=True))
    return {"bytes": total.item(), "save_s": seconds, "sums_s": sums}


def _load(n_params: int, path: str, check: bool = False) -> float:
    model, optimizers = _job(n_params)
    states = {"model": ModelWrapper([model]), "optimizer": optimizers}
    if check:  # as the checkpoint manager does: the ranks verify a share each, then DCP loads
        verified = lambda: verify(Path(path), shared=True)  # noqa: E731
        return _timed(lambda: (verified(), dcp.load(states, checkpoint_id=path)))
    return _timed(lambda: dcp.load(states, checkpoint_id=path))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", type=float, default=32e6, help="model parameters")
    parser.add_argument("--ranks", type=int, default=2, help="world size of the save")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    args = parser.parse_args(argv)
    n_params = int(1e6 if args.quick else args.params)
    other = args.ranks + 1
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        folder = Path(tmp)
        saved = run_ranks(args.ranks, _save, n_params, str(folder / "same"))[0]
        run_ranks(other, _save, n_params, str(folder / "other"))
        gb = saved["bytes"] / 1e9
        disk = disk_write_gbps(folder, max(64 * 2**20, int(saved["bytes"])))
        # Both loads run at the same world size, so only the shard layout differs.
        same = min(
            run_ranks(args.ranks, _load, n_params, str(folder / "same"))[0] for _ in range(SAVES)
        )
        checked = min(
            run_ranks(args.ranks, _load, n_params, str(folder / "same"), True)[0]
            for _ in range(SAVES)
        )
        resharded = min(
            run_ranks(args.ranks, _load, n_params, str(folder / "other"))[0] for _ in range(SAVES)
        )
        shutil.rmtree(folder / "same")
        shutil.rmtree(folder / "other")
    save_gbps, load_gbps = gb / saved["save_s"], gb / same
    rows = [
        ("disk sequential write (fsync)", f"{disk:.2f} GB/s", "", ""),
        (
            "DCP save (model + AdamW state)",
            f"{save_gbps:.2f} GB/s",
            f"{save_gbps / disk:.2f}",
            ">= 0.5",
        ),
        (f"DCP load at {args.ranks} ranks", f"{load_gbps:.2f} GB/s", f"{load_gbps / disk:.2f}", ""),
        (
            f"DCP load at {args.ranks} ranks: saved at {other} / at {args.ranks}",
            f"{resharded:.3f} s vs {same:.3f} s",
            f"{resharded / same:.2f}",
            "<= 1.2",
        ),
        (
            "save, then checksums recorded / save",
            f"{saved['save_s'] + saved['sums_s']:.3f} s vs {saved['save_s']:.3f} s",
            f"{(saved['save_s'] + saved['sums_s']) / saved['save_s']:.2f}",
            "<= 1.1",
        ),
        (
            f"checksums verified, then load / load, {args.ranks} ranks",
            f"{checked:.3f} s vs {same:.3f} s",
            f"{checked / same:.2f}",
            "<= 1.1",
        ),
    ]
    print(f"torch {torch.__version__}, {gb:.3f} GB checkpoint ({n_params / 1e6:.0f}M params)")
    print(markdown_table(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
