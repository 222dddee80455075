"""Training quality of mixed precision: fp32 vs FSDP2's bf16 policy vs the mixed-precision
container, on the debug job, with the memory per parameter each keeps.

    .venv/bin/python benchmarks/bench_mp_quality.py                    # seeds 0-2, accum 1 and 4
    .venv/bin/python benchmarks/bench_mp_quality.py --seeds 0 --accum 1 --steps 40 --window 10
    .venv/bin/python benchmarks/bench_mp_quality.py --quick            # smoke run, ~1 minute

Each run is `train.py --nproc_per_node 2` (2 gloo ranks, FSDP2) on the debug job with a log
line every step; its figure is the mean loss of the last `--window` steps. Contenders:
- fp32: `config/debug.toml` as it is;
- policy: the same with `--training.mixed_precision_param bfloat16` (reduce stays float32):
  torchtitan's default, bf16 compute on fp32 sharded parameters and optimizer state;
- container: `config/mixed_precision.toml`, bf16 parameters with fp32 masters.
The ratio is container / policy of the seed means. With accumulation A the local batch is
8 / A by default (`--local-batch-size` overrides), so every row steps on the same 16
sequences and costs about the same time: bf16 matrix products are ~14x slower than fp32 on a
CPU without bf16 units, and 200 steps of 4 x 8 sequences take ~25 minutes per bf16 run here.

The memory rows come from one extra 2-rank job per contender (`--measure-memory`, one step):
the local bytes each rank keeps between steps, per local parameter element: parameters,
gradients as they stand after backward (the container's fp32 sums included), optimizer state
and masters.

Runs whose folder under `--out` already holds `--steps` logged steps are read, not run
again, so an interrupted table resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import run_fresh  # noqa: E402

CONTENDERS: dict[str, list[str]] = {
    "fp32": ["--job.config_file", "config/debug.toml"],
    "policy": [
        "--job.config_file",
        "config/debug.toml",
        "--training.mixed_precision_param",
        "bfloat16",
    ],
    "container": ["--job.config_file", "config/mixed_precision.toml"],
}
QUICK = ["--model.flavor", "tiny", "--training.seq_len", "32", "--lr_scheduler.warmup_steps", "2"]


def _metrics(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_job(
    name: str, seed: int, accum: int, args: argparse.Namespace, contender: list[str] | None = None
) -> list[dict]:
    """The per-step records of one training run of `contender` (default: `CONTENDERS[name]`),
    run now unless `args.out` has them."""
    folder = Path(args.out) / f"{name}-seed{seed}-accum{accum}"
    records = _metrics(folder)
    if len(records) >= args.steps and records[args.steps - 1]["step"] == args.steps:
        return records[: args.steps]
    shutil.rmtree(folder, ignore_errors=True)
    batch = args.local_batch_size or max(1, 8 // accum)
    argv = [
        *(CONTENDERS[name] if contender is None else contender),
        *(QUICK if args.quick else []),
        "--job.dump_folder", str(folder),
        "--checkpoint.enable", "false",
        "--metrics.log_freq", "1",
        "--training.steps", str(args.steps),
        "--training.seed", str(seed),
        "--training.gradient_accumulation_steps", str(accum),
        "--training.local_batch_size", str(batch),
    ]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "train.py", "--nproc_per_node", str(args.nproc), *argv],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    print(
        f"  {name} seed {seed} accum {accum}: {time.perf_counter() - start:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    return _metrics(folder)[: args.steps]


def tail_mean(records: list[dict], window: int) -> float:
    return statistics.fmean(r["loss"] for r in records[-window:])


def _step_s(records: list[dict]) -> float:
    return statistics.median(r["step_time_s"] for r in records[1:])


def measure_memory(argv: list[str]) -> None:
    """Rank body of `--measure-memory` (under torchrun): one step of the job `argv`, then
    rank 0 prints the steady bytes per local parameter element as JSON."""
    import torch

    from components.job import build_job
    from config import load_job_config
    from containers.tensors import local

    job = build_job(load_job_config(argv))
    job.optimizers.zero_grad()
    for _ in range(job.accumulation_steps):
        job.forward_backward(*next(job.dataloader))
    params = job.parameters()
    grads = [p.grad for p in params if p.grad is not None]
    sums = getattr(job.optimizers.precision, "sums", None)  # fp32 gradient sums, if any
    grads += [m.grad for m in sums.master.values()] if sums is not None else []
    count = {"params": params, "grads": grads}
    job.optimizers.step()  # creates the optimizer state

    def nbytes(tensors: list[torch.Tensor]) -> int:
        return sum(local(t).numel() * local(t).element_size() for t in tensors)

    numel = sum(local(p).numel() for p in params)
    state = [
        v for opt in job.optimizers for st in opt.state.values() for v in st.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]  # fmt: skip
    stepped = [m for opt in job.optimizers for g in opt.param_groups for m in g["params"]]
    ids = {id(p) for p in params}
    masters = [m for m in stepped if id(m) not in ids]
    out = {k: nbytes(v) / numel for k, v in count.items()}
    out |= {"state": nbytes(state) / numel, "masters": nbytes(masters) / numel}
    job.close()
    if job.rank == 0:
        print(json.dumps(out))


def _memory(name: str, args: argparse.Namespace) -> dict[str, float]:
    folder = Path(args.out) / f"{name}-memory"
    shutil.rmtree(folder, ignore_errors=True)
    argv = [
        *CONTENDERS[name],
        *(QUICK if args.quick else []),
        "--job.dump_folder", str(folder),
        "--checkpoint.enable", "false",
        "--training.steps", "1",
        "--lr_scheduler.warmup_steps", "0",
    ]  # fmt: skip
    torchrun = Path(sys.executable).with_name("torchrun")
    return run_fresh(
        str(torchrun),
        ["--standalone", f"--nproc_per_node={args.nproc}", __file__, "--measure-memory", *argv],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--accum", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--window", type=int, default=20, help="mean loss of the last N steps")
    parser.add_argument("--local-batch-size", type=int, default=0, help="0: 8 / accum")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "outputs" / "bench_mp_quality"))
    parser.add_argument("--quick", action="store_true", help="tiny model, 6 steps: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.accum, args.steps, args.window = [0], [1], 6, 3
    names = list(CONTENDERS)
    lines = [
        f"{args.steps} steps, mean loss of the last {args.window}, {args.nproc} gloo ranks",
        "",
        "| seed | accum | fp32 | FSDP2 policy (bf16, reduce fp32) | container | container "
        "/ policy |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for accum in args.accum:
        means: dict[str, list[float]] = {n: [] for n in names}
        for seed in args.seeds:
            losses = {n: tail_mean(run_job(n, seed, accum, args), args.window) for n in names}
            for n in names:
                means[n].append(losses[n])
            f32, pol, mp = (losses[n] for n in names)
            lines.append(
                f"| {seed} | {accum} | {f32:.4f} | {pol:.4f} ({pol / f32 - 1:+.1%}) | "
                f"{mp:.4f} ({mp / f32 - 1:+.1%}) | {mp / pol:.4f} |"
            )
        f32, pol, mp = (statistics.fmean(means[n]) for n in names)
        lines.append(
            f"| mean | {accum} | {f32:.4f} | {pol:.4f} ({pol / f32 - 1:+.1%}) | "
            f"{mp:.4f} ({mp / f32 - 1:+.1%}) | **{mp / pol:.4f}** |"
        )
    first = args.accum[0]
    times = {
        n: statistics.median(_step_s(run_job(n, s, first, args)) for s in args.seeds) for n in names
    }
    lines += ["", "| bytes per parameter (steady, per rank) | " + " | ".join(names) + " |"]
    lines.append("| --- |" + " --- |" * len(names))
    memory = {n: _memory(n, args) for n in names}
    for key in ("params", "grads", "state", "masters"):
        lines.append(f"| {key} | " + " | ".join(f"{memory[n][key]:.2f}" for n in names) + " |")
    total = {n: sum(memory[n].values()) for n in names}
    lines.append("| **total** | " + " | ".join(f"**{total[n]:.2f}**" for n in names) + " |")
    lines.append(
        f"| step time, accum {first} (s, median) | "
        + " | ".join(f"{times[n]:.2f}" for n in names)
        + " |"
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--measure-memory":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        measure_memory(sys.argv[2:])
    else:
        sys.exit(main())
