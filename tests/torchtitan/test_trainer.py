"""torchtitan 0.3.0's own Trainer (its llama3 debug model; 2 CPU ranks, FSDP2, gloo; the
test-only shim in `cpu.py`) with `containers.torchtitan` as its optimizer: the default
container's losses equal torchtitan's own container's at every step, in-backward's equal an
unclipped run's, mixed precision follows within 1e-3 from masters equal to the fp32 init,
torchtitan's CheckpointManager resumes bitwise, and the in-backward clip is refused in one
line. One pair of ranks runs every job (module-scoped)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness.dist import run_ranks

STEPS = 12


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _jobs(tmp: str) -> dict[str, Any]:
    """Every job, in order, on this rank; what each logged (rank 0) and checked."""
    import torch.distributed as dist

    from tests.torchtitan import cpu

    cpu.apply()
    out: dict[str, Any] = {}
    init: dict[str, torch.Tensor] = {}

    def job(name: str, container: str | None, max_norm: float = 1.0, **checkpoint: Any) -> Any:
        config = cpu.debug_config(f"{tmp}/{name}", STEPS, container, max_norm)
        for key, value in checkpoint.items():
            setattr(config.checkpoint, key, value)
        try:
            trainer = config.build()
        except ValueError as e:
            out[name] = str(e)
            return None
        try:
            if name == "titan":  # the fp32 init the masters must equal
                init.update({k: _local(v) for k, v in trainer.model_parts[0].named_parameters()})
            if container == "mixed_precision":
                sd = trainer.optimizers.state_dict()
                masters = {k.removeprefix("master_weights."): _local(v) for k, v in sd.items()
                           if k.startswith("master_weights.")}  # fmt: skip
                out["masters_equal_init"] = masters.keys() == init.keys() and all(
                    torch.equal(masters[k], init[k]) for k in init
                )
                out["param_dtypes"] = sorted(
                    {str(p.dtype) for p in trainer.model_parts[0].parameters()}
                )
            if name == "nan_gradients":  # step 3's gradients NaN, its loss finite
                norm = trainer.model_parts[0].norm

                def poison(module: Any, args: Any, output: torch.Tensor) -> None:
                    if trainer.step == 3:
                        output.register_hook(lambda grad: grad * float("nan"))

                norm.register_forward_hook(poison)
            trainer.train()
            out[name] = trainer.metrics_processor.rows
            out[f"{name}.optimizer"] = type(trainer.optimizers).__name__
        finally:
            trainer.close()
        return trainer

    saving = {"enable": True, "interval": 5, "keep_latest_k": 0}
    job("titan", None)
    job("ours", "default", **saving)
    if dist.get_rank() == 0:
        step5 = Path(tmp, "ours", "checkpoint", "step-5")
        shutil.copytree(step5, Path(tmp, "resumed", "checkpoint", "step-5"))
    dist.barrier()
    job("resumed", "default", **saving)
    job("titan_unclipped", None, max_norm=1e30)
    job("in_backward", "in_backward", max_norm=0.0)
    job("mixed", "mixed_precision")
    job("nan_gradients", "default")
    job("in_backward_clipped", "in_backward", max_norm=1.0)
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_ranks(2, _jobs, str(tmp_path_factory.mktemp("titan")), timeout=600)[0]


def _losses(rows: dict[int, dict[str, Any]]) -> dict[int, float]:
    return {step: row["loss_metrics/global_avg_loss"] for step, row in rows.items()}


def test_the_default_container_equals_torchtitans_own_at_every_step(jobs):
    ours, theirs = _losses(jobs["ours"]), _losses(jobs["titan"])
    assert sorted(ours) == list(range(1, STEPS + 1)) and ours == theirs, (ours, theirs)
    assert theirs[STEPS] < theirs[1] - 1.0  # (it trains)
    assert jobs["ours.optimizer"] == "OptimizersContainer"
    assert [jobs["ours"][s]["grad_norm"] for s in ours] == [
        jobs["titan"][s]["grad_norm"] for s in ours
    ]
    # The step report in torchtitan's metrics (none for torchtitan's own container).
    assert jobs["ours"][STEPS]["optimizer/skipped_steps"] == 0
    assert jobs["ours"][STEPS]["optimizer/committed"] == 1
    assert "optimizer/skipped_steps" not in jobs["titan"][STEPS]


def test_torchtitans_checkpoint_manager_resumes_the_container_bitwise(jobs):
    resumed, ours = _losses(jobs["resumed"]), _losses(jobs["ours"])
    assert sorted(resumed) == list(range(6, STEPS + 1))
    assert resumed == {s: ours[s] for s in resumed}


def test_in_backward_without_a_clip_equals_an_unclipped_torchtitan_run(jobs):
    ours, theirs = _losses(jobs["in_backward"]), _losses(jobs["titan_unclipped"])
    assert jobs["in_backward.optimizer"] == "OptimizersInBackwardContainer"
    assert ours == theirs and len(ours) == STEPS


def test_mixed_precision_starts_from_the_fp32_init_and_follows_within_1e_3(jobs):
    assert jobs["masters_equal_init"] and jobs["param_dtypes"] == ["torch.bfloat16"]
    mixed, fp32 = _losses(jobs["mixed"]), _losses(jobs["titan"])
    assert mixed[STEPS] == pytest.approx(fp32[STEPS], rel=1e-3), (mixed[STEPS], fp32[STEPS])
    assert mixed[STEPS] != fp32[STEPS]  # (bf16 weights: not the fp32 run itself)


def test_in_backward_refuses_torchtitans_clip_in_one_line(jobs):
    said = jobs["in_backward_clipped"]
    assert said == (
        "optimizer.container = 'in_backward' steps inside backward, so torchtitan's "
        "training.max_norm = 1.0 would clip gradients already applied and freed (silently no "
        "clip): set training.max_norm = 0, or use container 'default' to clip"
    )


def test_a_step_with_nan_gradients_is_skipped_and_counted_in_torchtitans_metrics(jobs):
    """Step 3's gradients are NaN (its loss finite, so torchtitan trains on): the container
    skips it and the metrics say so from then on; step 4's loss is not the clean run's, which
    applied step 3."""
    rows, clean = jobs["nan_gradients"], jobs["ours"]
    assert [rows[s]["optimizer/committed"] for s in (2, 3, 4)] == [1, 0, 1]
    assert [rows[s]["optimizer/skipped_steps"] for s in (2, 3, STEPS)] == [0, 1, 1]
    assert _losses(rows)[3] == _losses(clean)[3]  # (the forward before the NaN backward)
    assert _losses(rows)[4] != _losses(clean)[4]  # (weights of step 2, another batch)
