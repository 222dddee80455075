"""The benchmarks still run (smoke runs; their figures are not checked)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_bench_step_quick_prints_its_table(capsys):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_step.py"
    spec = importlib.util.spec_from_file_location("bench_step", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_step"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    assert module.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "container, skip_nonfinite=False / per-part loop" in out and "copy bandwidth" in out


@pytest.mark.slow
def test_bench_cuda_quick_passes_its_checks_on_this_machine(capsys):
    """Its checks (parity, skips, the flag, offload, remainders) run on a CPU too."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import bench_cuda

    assert bench_cuda.main(["--quick", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and out.count("PASS") == len(bench_cuda.CHECKS)
    assert "check on" in out and "bf16 moments" in out


def test_moment_codes_blocks_move_whole_with_rows_and_32_column_cuts():
    """What the 8-bit design rests on: a code's blocks lie within a row, 32 columns wide, so a
    shard cut between rows (FSDP2, TP) or at a multiple of 32 columns holds the same values
    as the whole tensor coded at once; a cut inside a block does not (the check can fail)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    from benchmarks.bench_moment_codes import CODES

    torch.manual_seed(0)
    t = torch.randn(6, 96) * 10 ** (-8 * torch.rand(6, 96))  # wide ranges within each block
    coded = 0
    for name, pair in CODES.items():
        for code, x in zip(pair, (t, t.square())):
            if code is None:
                continue
            whole = code(x)
            assert torch.equal(code(whole), whole), name  # what it holds, it holds again
            assert torch.equal(torch.cat([code(x[:2]), code(x[2:])]), whole), name
            assert torch.equal(torch.cat([code(x[:, :64]), code(x[:, 64:])], 1), whole), name
            if name != "e5m2":  # blocks: a cut at column 48 splits one
                assert not torch.equal(torch.cat([code(x[:, :48]), code(x[:, 48:])], 1), whole)
            coded += 1
    assert coded == 9


def test_bench_experts_quick_prints_its_table(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import bench_experts

    assert bench_experts.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert out.count("<= 1.05") == len(bench_experts.OPTIMIZERS)


@pytest.mark.slow
def test_bench_moe_quick_counts_all_to_all_bytes_only_with_expert_parallelism(capsys):
    from benchmarks import bench_moe

    assert bench_moe.main(["--quick"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()[2:]]
    sent = {int(row[1]): float(row[4]) for row in rows}
    assert sent[1] == 0.0 and sent[2] > 0.0
