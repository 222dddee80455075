"""Which 8-bit codes of AdamW's moments keep the debug job's quality (issue 29's stretch).

    .venv/bin/python benchmarks/bench_moment_codes.py                     # every code, seeds 0-2
    .venv/bin/python benchmarks/bench_moment_codes.py --codes m8,m8-v8log --seeds 0

Measured before anything is built: each code is emulated by an AdamW that steps in fp32
(torch's fused kernel) and then replaces its moments by the values the code can hold, so the
run follows what an optimizer keeping only the codes would do (its rounding, its stalls: a
moment whose change is below half a step of the code stays where it is). train.py's debug job
on 2 ranks, 200 steps, each seed; the mean loss of steps 181-200 against fp32 AdamW's, the goal
within 1% averaged over the seeds. About 45 s a run on 2 cores.

Blocks are 32 consecutive elements of a row (the last dimension) of each local shard, so no
block crosses a boundary where FSDP2 (rows) or tensor parallelism (rows, or columns at
multiples of 32) cuts a parameter: the state of a block moves whole when a checkpoint is
resharded. The codes:
- `m8`: `exp_avg` as int8 times a power-of-two scale per block (the smallest with every
  |value| / scale <= 127); `exp_avg_sq` kept fp32.
- `m8-v8log`: and `exp_avg_sq` as an 8-bit logarithm below its block's maximum, kept in fp32:
  254 steps over 40 octaves, rounded in the log domain; 0 stays 0, smaller values are raised to
  the lowest step (an overestimate: a smaller update, never a division by `eps` alone).
  These two are `containers.optim.moment_codes`, the codes built.
- `m8-v8float`: `exp_avg_sq` as a float of 3 mantissa bits over the 32 octaves below its
  block's maximum exponent (bf16-exact values), rounded to nearest; `-up`: rounded up.
- `e5m2`: no blocks and no scales: each element a float of its own, `exp_avg` with a sign, 5
  exponent bits (2^-28..14) and 2 mantissa bits, `exp_avg_sq` with 6 and 2 (2^-56..2^8).
"""

from __future__ import annotations

import argparse
import logging
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from containers.update import codes8 as moment_codes  # noqa: E402
from containers.update.codes8 import as_blocks, from_blocks  # noqa: E402

Code = Callable[[torch.Tensor], torch.Tensor]  # fp32 local shard -> the values the code holds


def _coded(encode: Callable, decode: Callable, code_dtype: torch.dtype) -> Code:
    """What a code of `containers.optim.moment_codes` holds of a tensor (the one built)."""

    def held(t: torch.Tensor) -> torch.Tensor:
        code = torch.empty(t.shape, dtype=code_dtype)
        scale = torch.empty(moment_codes.scale_shape(t.shape))
        encode(t, code, scale)
        out = torch.empty_like(t)
        decode(code, scale, out)
        return out

    return held


int8_pow2 = _coded(moment_codes.encode_signed, moment_codes.decode_signed, torch.int8)
log8 = _coded(moment_codes.encode_log, moment_codes.decode_log, torch.uint8)


def float8_below_max(t: torch.Tensor, up: bool = False) -> torch.Tensor:
    """A float of 3 mantissa bits over the 32 octaves below the block's maximum exponent;
    smaller nonzero values raised to the lowest, 0 kept 0."""
    b = as_blocks(t.clamp_min(0))

    def held_at(a: torch.Tensor) -> torch.Tensor:
        ulp = torch.exp2(torch.floor(torch.log2(a)) - 3)
        return (torch.ceil(a / ulp) if up else torch.round(a / ulp)) * ulp

    # the exponent of the maximum as held (it may round up an octave): held values hold again
    top = held_at(b.amax(-1, keepdim=True).clamp_min(2.0**-126))
    a = torch.maximum(b, torch.exp2(torch.floor(torch.log2(top)) - 31))
    held = held_at(a)
    return from_blocks(torch.where(b > 0, held, torch.zeros_like(b)), t.shape)


def minifloat(t: torch.Tensor, lo: int, hi: int, mantissa: int) -> torch.Tensor:
    """Each element alone: exponents lo..hi, `mantissa` bits, saturated above, below 2^lo
    rounded to 0 or 2^lo, sign kept."""
    a = t.abs()
    ulp = torch.exp2(torch.floor(torch.log2(a.clamp_min(2.0**lo))).clamp(lo, hi) - mantissa)
    held = (torch.round(a / ulp) * ulp).clamp(max=2.0**hi * (2 - 2.0**-mantissa))
    held = torch.where(a < 2.0**lo, torch.where(a < 2.0 ** (lo - 1), 0.0, 2.0**lo), held)
    return held * t.sign()


CODES: dict[str, tuple[Code | None, Code | None]] = {
    "fp32": (None, None),
    "m8": (int8_pow2, None),
    "m8-v8log": (int8_pow2, log8),
    "m8-v8float": (int8_pow2, float8_below_max),
    "m8-v8float-up": (int8_pow2, lambda t: float8_below_max(t, up=True)),
    "e5m2": (lambda t: minifloat(t, -28, 3, 2), lambda t: minifloat(t, -56, 7, 2)),
}


class CodedAdamW(torch.optim.AdamW):
    """AdamW whose moments, after each step, hold only what `codes` (exp_avg's, exp_avg_sq's)
    can: an emulation of keeping them in that code."""

    codes: tuple[Code | None, Code | None] = (None, None)

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> torch.Tensor | None:
        loss = super().step(closure)
        for state in self.state.values():
            for name, code in zip(("exp_avg", "exp_avg_sq"), self.codes):
                if code is not None and name in state:
                    t = state[name]
                    local = t.to_local() if isinstance(t, DTensor) else t
                    local.copy_(code(local.float()))
        return loss


def register() -> None:
    """`[optimizer] name = "AdamW-<code>"` for each code (in every process of a run)."""
    from components.optimizer.registry import OPTIMIZERS, register_optimizer

    for name, codes in CODES.items():
        cls = type(f"CodedAdamW_{name}", (CodedAdamW,), {"codes": codes})

        def factory(cfg: object, cls: type = cls) -> tuple[type, dict]:
            _, kwargs = OPTIMIZERS["AdamW"](cfg)
            return cls, kwargs

        register_optimizer(f"AdamW-{name}", factory)


def _strip(argv: list[str]) -> list[str]:
    return [a for a in argv if a != "--train"]


def train(argv: list[str]) -> int:
    """train.py with the codes registered, its ranks started as this file (`--train`)."""
    import train as trainer

    register()
    return trainer.run(
        argv, script=__file__, entry=lambda a: trainer.main(_strip(a)), train_args=_strip
    )


def tail_loss(code: str, seed: int, args: argparse.Namespace) -> float:
    """Mean loss of the last 20 steps of one run (run now unless its log is there)."""
    log = Path(args.out) / f"{code}-seed{seed}.log"
    if not log.exists() or f"step {args.steps:5d}" not in log.read_text():
        start = time.perf_counter()
        argv = [
            sys.executable, __file__, "--train", "--nproc_per_node", "2",
            "--optimizer.name", f"AdamW-{code}", "--training.steps", str(args.steps),
            "--training.seed", str(seed), "--checkpoint.enable", "false",
            "--metrics.log_freq", "1", "--job.dump_folder", str(Path(args.out) / f"{code}-{seed}"),
        ]  # fmt: skip
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        log.write_text(done.stdout + done.stderr)
        if done.returncode:
            raise RuntimeError(f"{code} seed {seed}: exit {done.returncode}, see {log}")
        print(f"  {code} seed {seed}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    losses = {
        int(s): float(v) for s, v in re.findall(r"step\s+(\d+)\s+loss ([\d.]+)", log.read_text())
    }
    return statistics.fmean(losses[s] for s in range(args.steps - 19, args.steps + 1))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--codes", default=",".join(c for c in CODES if c != "fp32"))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="/tmp/bench_moment_codes", help="runs kept here")
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    codes = ["fp32", *(c for c in args.codes.split(",") if c != "fp32")]
    unknown = [c for c in codes if c not in CODES]
    if unknown:
        raise SystemExit(f"--codes: unknown {unknown}; known: {', '.join(CODES)}")
    losses = {c: [tail_loss(c, s, args) for s in seeds] for c in codes}
    base = statistics.fmean(losses["fp32"])
    print(f"| code | {' | '.join(f'seed {s}' for s in seeds)} | mean | vs fp32 | goal within 1% |")
    print(f"|---|{'---|' * len(seeds)}---|---|---|")
    for c in codes:
        mean = statistics.fmean(losses[c])
        cells = " | ".join(f"{v:.4f}" for v in losses[c])
        verdict = "" if c == "fp32" else ("PASS" if abs(mean / base - 1) <= 0.01 else "MISS")
        print(f"| {c} | {cells} | {mean:.4f} | {100 * (mean / base - 1):+.2f}% | {verdict} |")


if __name__ == "__main__":
    if "--train" in sys.argv:
        from train import FORMAT, exit_now

        logging.basicConfig(level=logging.INFO, format=FORMAT)
        exit_now(train(sys.argv[1:]))
    main(sys.argv[1:])
