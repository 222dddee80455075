"""Step time inside torchtitan 0.3.0's own Trainer: the containers against its own container.

    .venv/bin/python benchmarks/bench_torchtitan.py            # ~3 minutes
    .venv/bin/python benchmarks/bench_torchtitan.py --quick    # smoke run

torchtitan's llama3 debug model on 2 CPU ranks (FSDP2, gloo, torchrun; the test shim
`tests/torchtitan/cpu.py`). One pair of processes trains every job `--steps` steps, round
after round (the order reversed on odd rounds); a job's time is the median wall time of its
steps after the first two (torchtitan's `time_metrics/end_to_end(s)`, logged every step), and
each ratio is taken against torchtitan's own container in the same round, then the median of
the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import markdown_table  # noqa: E402

# name -> (our container or None for torchtitan's own, training.max_norm)
JOBS = {
    "torchtitan's own container": (None, 1.0),
    "default container": ("default", 1.0),
    "mixed precision (bf16 weights, fp32 masters)": ("mixed_precision", 1.0),
    "in-backward (max_norm 0)": ("in_backward", 0.0),
}


def child(steps: int, repeats: int, folder: str) -> None:
    """Under torchrun: every job, round after round; rank 0 prints the step times."""
    import torch.distributed as dist

    from tests.torchtitan import cpu

    cpu.apply()
    times: dict[str, list[float]] = {name: [] for name in JOBS}
    for round_ in range(repeats):
        order = list(JOBS) if round_ % 2 == 0 else list(reversed(JOBS))
        for name in order:
            container, max_norm = JOBS[name]
            dump = f"{folder}/{round_}-{len(times[name])}"
            config = cpu.debug_config(dump, steps, container, max_norm)
            trainer = config.build()
            try:
                trainer.train()
            finally:
                trainer.close()
            rows = trainer.metrics_processor.rows
            step_s = [rows[s]["time_metrics/end_to_end(s)"] for s in sorted(rows)[2:]]
            times[name].append(statistics.median(step_s))
    if dist.get_rank() == 0:
        print(json.dumps(times))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="5 steps, 1 round")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps, repeats = (5, 1) if args.quick else (args.steps, args.repeats)
    if args.child:
        child(steps, repeats, args.child)
        return 0
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", __file__, "--child", folder,
               "--steps", str(steps), "--repeats", str(repeats)]  # fmt: skip
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        return done.returncode
    line = next(x for x in reversed(done.stdout.splitlines()) if x.startswith('{"torchtitan'))
    times = json.loads(line)
    base = times["torchtitan's own container"]
    rows = []
    for name, seconds in times.items():
        ratios = [s / b for s, b in zip(seconds, base)]
        rows.append(
            (name, f"{statistics.median(seconds) * 1e3:.1f}", f"{statistics.median(ratios):.2f}x")
        )
    print(
        f"torchtitan 0.3.0 Trainer, llama3 debug model, 2 CPU ranks, {steps} steps x {repeats} "
        "rounds\n"
    )
    print(markdown_table(rows, ("job", "step ms (median)", "/ torchtitan's own")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
