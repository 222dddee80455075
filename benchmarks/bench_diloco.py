"""DiLoCo against every-step averaging: bytes each replica group sends per inner step, and loss.

    .venv/bin/python benchmarks/bench_diloco.py [--steps 200] [--sync 1 4 16] [--no-streaming]

Two replica groups of the debug job (one process each, a real torchft lighthouse that waits for
both, loopback gloo), trained through train.py side by side in one run per setting: every-step
gradient averaging (`semi_sync_method = "none"`) and DiLoCo at each `sync_steps`. Bytes per
inner step: each collective the torchft parts make is one flat fp32 all-reduce of every trainable
parameter (the gradients every step; the pseudo-gradients every `sync_steps`), so a group
hands `4 x parameters / sync_steps` bytes to the all-reduce per step (a ring all-reduce moves
about twice that over the wire). Loss: the mean of the last 20 steps over both groups. Two
more rows move the bytes of sync_steps 16 with the averages delayed (`fragment_sync_delay`):
one fragment 4 steps late, and 4 fragments (streaming) 2 steps late each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table
from tests.harness.ftjob import FTJob


def trainable_params() -> int:
    """The debug job's trainable parameters (what each all-reduce carries, in fp32)."""
    from components.models.llama.model import FLAVORS, Transformer

    return sum(p.numel() for p in Transformer(FLAVORS["debug"]).parameters() if p.requires_grad)


def run(folder: Path, steps: int, extra: list[str]) -> tuple[float, float]:
    """(mean loss of the last 20 steps over both groups, the groups' wall seconds)."""
    folder.mkdir()
    job = FTJob(folder, steps, ["--metrics.log_freq", "1", *extra], min_replicas=2, flavor="debug")
    job.run_both(timeout=1200)
    losses = [job.metrics(r)[s]["loss"] for r in (0, 1) for s in range(steps - 19, steps + 1)]
    seconds = max(sum(m["step_time_s"] for m in job.metrics(r).values()) for r in (0, 1))
    return statistics.fmean(losses), seconds


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sync", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--no-streaming", action="store_true", help="leave out the delay rows")
    args = parser.parse_args(argv)
    settings = {"every-step averaging": ([], 1)}
    diloco = ["--fault_tolerance.semi_sync_method", "diloco"]
    for k in args.sync:
        settings[f"DiLoCo, sync_steps {k}"] = ([*diloco, "--fault_tolerance.sync_steps", str(k)], k)
    if not args.no_streaming:  # the same bytes per step as sync_steps 16, averages delayed
        for fragments, delay in ((1, 4), (4, 2)):
            settings[f"DiLoCo, sync_steps 16, {fragments} fragment(s), delay {delay}"] = (
                [
                    *diloco, "--fault_tolerance.sync_steps", "16",
                    "--fault_tolerance.num_fragments", str(fragments),
                    "--fault_tolerance.fragment_sync_delay", str(delay),
                ],
                16,
            )  # fmt: skip
    rows, params = [], trainable_params()
    with tempfile.TemporaryDirectory() as tmp:
        base_loss = None
        for i, (name, (extra, every)) in enumerate(settings.items()):
            loss, seconds = run(Path(tmp) / f"s{i}", args.steps, extra)
            base_loss = loss if base_loss is None else base_loss
            sent = 4 * params / every
            rows.append(
                (
                    name,
                    f"{sent / 1e6:.2f} MB ({1 / every:.3f}x)",
                    f"{loss:.4f} ({loss / base_loss:.3f}x)",
                    f"{seconds:.0f} s",
                )
            )
            print(f"  {name}: {loss:.4f}, {seconds:.0f} s", flush=True)
    print(
        f"\n2 replica groups x 1 process, debug job (seq 64, batch 4; {params / 1e6:.2f}M "
        f"parameters), {args.steps} steps\n\n"
        + markdown_table(rows, ("", "all-reduce bytes / inner step", "final loss", "train time"))
    )


if __name__ == "__main__":
    main(sys.argv[1:])
