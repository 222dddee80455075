"""The MoE debug job (config/moe.toml) through train.py at expert parallelism 1 and 2, side by
side: tokens/s and the bytes each rank's all-to-alls send to other ranks per step.

    .venv/bin/python benchmarks/bench_moe.py            # 2 ranks, 60 steps each, ~3 min
    .venv/bin/python benchmarks/bench_moe.py --quick    # smoke run

Each run is train.py itself (its launcher, gloo on a CPU); each rank counts the rows that
`dist.all_to_all_single` moves to another rank (forward dispatch and combine, and their
backward), and rank 0 writes its count. tokens/s is the median of the metrics rows after the
first 10 steps. The runs alternate (EP 1, EP 2, EP 1, ...) over `--repeats`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COUNT_FILE = "all_to_all_bytes.json"


def _worker(argv: list[str]) -> int:
    """train.main(argv) with each all-to-all's bytes to other ranks counted (on every rank)."""
    import torch.distributed as dist

    import train

    sent = [0]
    all_to_all = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                 **kw):  # fmt: skip
        me = dist.get_rank(group)
        rows = input_split_sizes or [input.shape[0] // dist.get_world_size(group)] * (
            dist.get_world_size(group)
        )
        row_bytes = input[:1].numel() * input.element_size() if input.shape[0] else 0
        sent[0] += sum(n for r, n in enumerate(rows) if r != me) * row_bytes
        return all_to_all(output, input, output_split_sizes, input_split_sizes, group, **kw)

    dist.all_to_all_single = counting
    code = train.main(argv)
    dump = argv[argv.index("--job.dump_folder") + 1]
    if int(os.environ.get("RANK", "0")) == 0:
        Path(dump, COUNT_FILE).write_text(json.dumps({"bytes": sent[0]}))
    return code


def _run(ep: int, steps: int, dump: Path, quick: bool) -> dict[str, float]:
    args = [
        "--job.config_file", "config/moe.toml", "--parallelism.expert_parallel_degree", str(ep),
        "--training.steps", str(steps), "--checkpoint.enable", "false",
        "--metrics.log_freq", "1", "--job.dump_folder", str(dump),
    ]  # fmt: skip
    if quick:
        args += ["--model.flavor", "tiny", "--training.seq_len", "32"]
        args += ["--lr_scheduler.warmup_steps", "1"]
    cmd = [sys.executable, __file__, "--worker", *args, "--nproc_per_node", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    steady = [r["tokens_per_s"] for r in rows if r["step"] > min(10, steps - 2)]
    sent = json.loads((dump / COUNT_FILE).read_text())["bytes"]
    return {"tokens_per_s": statistics.median(steady), "bytes_per_step": sent / steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 4 steps, 1 repeat")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    opts = parser.parse_args(argv)
    steps, repeats = (4, 1) if opts.quick else (opts.steps, opts.repeats)
    results: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            for ep in (1, 2) if i % 2 == 0 else (2, 1):
                results[ep].append(_run(ep, steps, Path(tmp, f"ep{ep}-{i}"), opts.quick))
    base = statistics.median(r["tokens_per_s"] for r in results[1])
    print(
        "| expert_parallel_degree | tokens/s (2 ranks) | / EP 1 | all-to-all MiB per rank a step |"
    )
    print("|---|---|---|---|")
    for ep, runs in results.items():
        tps = statistics.median(r["tokens_per_s"] for r in runs)
        mib = statistics.median(r["bytes_per_step"] for r in runs) / 2**20
        print(f"| {ep} | {tps:.0f} | {tps / base:.2f} | {mib:.2f} |")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"] or "RANK" in os.environ:  # the launcher, or a rank
        import logging

        import train

        logging.basicConfig(level=logging.INFO, format=train.FORMAT)
        args = [a for a in sys.argv[1:] if a != "--worker"]
        train.exit_now(train.run(args, __file__, _worker))
    sys.exit(main())
