"""The benchmarks still run (smoke runs; their figures are not checked)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def test_bench_step_quick_prints_its_table(capsys):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_step.py"
    spec = importlib.util.spec_from_file_location("bench_step", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_step"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    assert module.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "container, skip_nonfinite=False / per-part loop" in out and "copy bandwidth" in out


def test_bench_cuda_quick_passes_its_checks_on_this_machine(capsys):
    """Its checks (parity, skips, the flag, offload, remainders) run on a CPU too."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import bench_cuda

    assert bench_cuda.main(["--quick", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and out.count("PASS") == len(bench_cuda.CHECKS)
    assert "check on" in out and "bf16 moments" in out
