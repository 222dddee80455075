"""Muon on sharded matrices: orthogonalization spread over ranks vs every rank doing all of it.

    .venv/bin/python benchmarks/bench_muon.py [--dim 256] [--layers 4] [--ranks 1 2 4] [--torch]
                                              [--ns-dtype float32] [--quick]

For each world size W (gloo ranks on this machine, one torch thread each), the hidden matrices
of a Llama-like stack (per layer wq, wk, wv, wo: dim x dim; w1, w3: hidden x dim; w2:
dim x hidden) are FSDP2-style Shard(0) DTensors with fixed gradients, and each contender's
step is timed (median of `--steps`, after 2 warm-up steps):
- `ShardedMuon` (containers.optim.muon): each matrix gathered to one owner by all-to-all,
  orthogonalized there, returned as shards: ~1/W of the Newton-Schulz work per rank;
- every rank gathers every matrix (`full_tensor`) and orthogonalizes all of them, then keeps its
  shard: what DTensor ops make of torch's Muon, with the same Newton-Schulz dtype;
- fused `torch.optim.AdamW` on the same parameters (the elementwise step Muon replaces);
- with `--torch`, `torch.optim.Muon` itself on the DTensors (Newton-Schulz in bf16 always:
  ~65x slower than fp32 on CPUs without bf16 units, so minutes here).
`--ns-dtype` (default float32, what "auto" picks on CPU) sets both Muons' Newton-Schulz dtype.
With W ranks on fewer cores than W, ranks share cores: wall time then measures total work,
which is what spreading cuts.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table
from containers.optim.muon import ShardedMuon, newton_schulz


class EveryRankMuon(ShardedMuon):
    """Every rank gathers every matrix and orthogonalizes all of them (no spreading)."""

    def _orthogonalize(self, params, updates, group):
        from torch.distributed.tensor import DTensor, distribute_tensor

        ns = (group["ns_coefficients"], group["ns_steps"], group["eps"])
        dtype = getattr(torch, group["ns_dtype"])
        out = []
        for p, u in zip(params, updates):
            whole = DTensor.from_local(
                u, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            ).full_tensor()
            o = newton_schulz(whole, *ns, dtype)
            out.append(distribute_tensor(o, p.device_mesh, p.placements, src_data_rank=None))
        return [o.to_local() for o in out]


MUON = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}


def _shapes(dim: int, layers: int) -> list[tuple[int, int]]:
    hidden = int(8 * dim / 3) // 16 * 16
    per_layer = [(dim, dim)] * 4 + [(hidden, dim)] * 2 + [(dim, hidden)]
    return per_layer * layers


def _params(shapes: list[tuple[int, int]], mesh) -> list[torch.nn.Parameter]:
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(
            distribute_tensor(torch.randn(shape, generator=g) * 0.02, mesh, [Shard(0)])
        )
        p.grad = distribute_tensor(torch.randn(shape, generator=g), mesh, [Shard(0)])
        params.append(p)
    return params


def _time(opt: torch.optim.Optimizer, steps: int) -> float:
    for _ in range(2):
        opt.step()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: mp.Queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    shapes = _shapes(args.dim, args.layers)
    kw = {**MUON, "ns_dtype": args.ns_dtype}
    result = {
        "sharded": _time(ShardedMuon(_params(shapes, mesh), **kw), args.steps),
        "every": _time(EveryRankMuon(_params(shapes, mesh), **kw), args.steps),
        "adamw": _time(torch.optim.AdamW(_params(shapes, mesh), lr=3e-3, fused=True), args.steps),
    }
    if args.torch:
        result["torch"] = _time(torch.optim.Muon(_params(shapes, mesh), **MUON), args.steps)
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ns-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--torch", action="store_true", help="also time torch.optim.Muon")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks it runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.dim, args.layers, args.ranks, args.steps = 32, 1, [1, 2], 1
    shapes = _shapes(args.dim, args.layers)
    n = sum(a * b for a, b in shapes)
    print(
        f"torch {torch.__version__}, {len(shapes)} matrices, {n:,} params, 1 thread per rank, "
        f"Newton-Schulz in {args.ns_dtype}"
    )
    rows, base = [], None
    ctx = mp.get_context("spawn")
    for world in args.ranks:
        out = ctx.Queue()
        mp.start_processes(
            _rank, args=(world, _free_port(), args, out), nprocs=world, start_method="spawn"
        )
        t = out.get()
        base = base or t["sharded"]
        rows += [
            (f"{world} ranks: ShardedMuon step", f"{t['sharded']:.1f} ms", "", ""),
            (
                f"{world} ranks: every rank every matrix / ShardedMuon",
                f"{t['every']:.1f} ms",
                f"{t['every'] / t['sharded']:.2f}",
                ">= 1 at 2+ ranks",
            ),
            (
                f"{world} ranks: ShardedMuon / ShardedMuon at 1 rank",
                "",
                f"{t['sharded'] / base:.2f}",
                "falls with ranks",
            ),
            (
                f"{world} ranks: ShardedMuon / fused AdamW",
                f"{t['adamw']:.2f} ms",
                f"{t['sharded'] / t['adamw']:.1f}",
                "",
            ),
        ]
        if "torch" in t:
            rows.append(
                (
                    f"{world} ranks: torch.optim.Muon (bf16) / ShardedMuon",
                    f"{t['torch']:.1f} ms",
                    f"{t['torch'] / t['sharded']:.2f}",
                    "",
                )
            )
    print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
