"""Pipeline stages on their own ranks (and tensor parallelism) train as the unsplit model does:
the same losses, step by step, for every container."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from components.job import build_job
from config import load_job_config
from tests.harness.dist import run_ranks

STEPS = 6
COMMON = [
    "--job.config_file",
    "config/debug.toml",
    "--training.seq_len",
    "16",
    "--training.local_batch_size",
    "4",
    "--lr_scheduler.warmup_steps",
    "2",
    "--checkpoint.enable",
    "false",
    "--training.gradient_accumulation_steps",
    "2",
]
IN_BACKWARD = ["--optimizer.container", "in_backward", "--training.max_norm", "0"]
CONTAINERS = {
    "default": ["--training.max_norm", "0"],
    "clipped": ["--training.max_norm", "0.5"],  # the global norm over both stages clips
    # SGD: AdamW hardly sees gradients scaled by a constant, as a mis-scaled unit's would be.
    "in_backward": [*IN_BACKWARD, "--optimizer.name", "SGD", "--optimizer.lr", "0.1"],
    "mixed_precision": ["--optimizer.container", "mixed_precision", "--training.max_norm", "0"],
}
LAYOUTS = {
    "GPipe": ["--parallelism.pipeline_parallel_schedule", "GPipe"],
    "1F1B": ["--parallelism.pipeline_parallel_schedule", "1F1B"],
    "Interleaved1F1B": [
        "--parallelism.pipeline_parallel_schedule",
        "Interleaved1F1B",
        "--model.num_parts",
        "4",
    ],
}


def _losses(argv: list[str], dump: str) -> list[float]:
    """Train `STEPS` steps as train.py does; the mean loss of each step, as rank 0 logs it."""
    job = build_job(load_job_config([*argv, "--job.dump_folder", dump]))
    losses = []
    try:
        for _ in range(STEPS):
            job.optimizers.zero_grad()
            loss = sum(job.forward_backward(*next(job.dataloader)) for _ in range(2))
            job.optimizers.step()
            assert job.optimizers.last_report.committed, job.optimizers.last_report
            job.lr_schedulers.step()
            if job.world_size > 1:
                dist.all_reduce(loss)
            losses.append(loss.item() / job.loss_ranks)
    finally:
        job.checkpoint.close()
        job.release_folder()
    return losses


def _runs(runs: dict[str, list[str]], dump: str) -> dict[str, list[float]]:
    rank = dist.get_rank()
    return {name: _losses(argv, f"{dump}/{name}/{rank}") for name, argv in runs.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, list[float]]:
    """Each container on one process, the model in two parts."""
    dump = str(tmp_path_factory.mktemp("one_process"))
    runs = {name: [*COMMON, *argv] for name, argv in CONTAINERS.items()}
    return run_ranks(1, _runs, runs, dump)[0]


@pytest.mark.slow
def test_two_pipeline_or_tensor_parallel_ranks_match_one_process_for_every_container(
    reference, tmp_path
):
    runs = {
        f"{container}/{layout}": [
            *COMMON,
            *argv,
            *schedule,
            "--parallelism.pipeline_parallel_degree",
            "2",
        ]
        for container, argv in CONTAINERS.items()
        for layout, schedule in LAYOUTS.items()
    }
    # Two tensor-parallel ranks, every container.
    runs |= {
        f"{container}/tp2": [*COMMON, *argv, "--parallelism.tensor_parallel_degree", "2"]
        for container, argv in CONTAINERS.items()
    }
    by_rank = run_ranks(2, _runs, runs, str(tmp_path), timeout=600)
    assert by_rank[0] == by_rank[1]  # every rank logs the same mean loss
    for name, losses in by_rank[0].items():
        container = name.split("/")[0]
        # Micro-batches and shards change the order of sums, not the math; bf16 rounds more.
        tolerance = 3e-3 if container == "mixed_precision" else 1e-5
        worst = max(abs(a - b) / b for a, b in zip(losses, reference[container]))
        assert worst <= tolerance, (name, losses, reference[container])
        assert losses[-1] < losses[0] - 0.5, (name, losses)  # it really trains


@pytest.mark.slow
def test_stages_sharded_with_fsdp2_match_fsdp2_alone(tmp_path):
    """PP2 x DP2 against DP2: the same data-parallel batches, stages sharded over dp_shard
    (FSDP2 reduces once per schedule step there, after every micro-batch's backward)."""
    picked = {k: CONTAINERS[k] for k in ("clipped", "in_backward", "mixed_precision")}
    dp2 = run_ranks(2, _runs, {k: [*COMMON, *v] for k, v in picked.items()}, f"{tmp_path}/dp")
    pp = ["--parallelism.pipeline_parallel_degree", "2"]
    runs = {k: [*COMMON, *v, *pp] for k, v in picked.items()}
    by_rank = run_ranks(4, _runs, runs, f"{tmp_path}/pp", timeout=600)
    assert all(r == by_rank[0] for r in by_rank)
    for name, losses in by_rank[0].items():
        tolerance = 3e-3 if name == "mixed_precision" else 1e-5
        worst = max(abs(a - b) / b for a, b in zip(losses, dp2[0][name]))
        assert worst <= tolerance, (name, losses, dp2[0][name])
