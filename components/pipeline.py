"""Forward and backward of one micro-batch over a rank's model parts: in sequence when the rank
holds them all, through a `torch.distributed.pipelining` schedule when they are pipeline stages
spread over the pp dimension. `train.py` calls either the same way."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from components.parallel_dims import ParallelDims
from components.train_spec import LossFn
from config import Parallelism
from containers import OptimizersContainer

__all__ = ["Evaluate", "ForwardBackward", "backward_passes", "build_passes"]

ForwardBackward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""`(inputs, labels) -> loss`: runs forward and backward of one micro-batch (gradients
accumulate) and returns its detached loss, already divided by the accumulation steps; zero on
ranks that hold no last stage."""
Evaluate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""`(inputs, labels) -> loss` of one micro-batch, forward only, without gradients (the loss
itself, not divided by the accumulation steps); zero on ranks that hold no last stage."""


def backward_passes(dims: ParallelDims, cfg: Parallelism, local_batch_size: int, accum: int) -> int:
    """Backward passes that deliver gradients to a parameter per optimizer step (what the
    in-backward container counts before a unit's gradients are final): one per micro-batch,
    and under a pipeline one per pipeline micro-batch, except that FSDP2 under a schedule
    reduces gradients (and fires their hooks) once per schedule step."""
    if dims.pp == 1 or dims.dp > 1:
        return accum
    return accum * (local_batch_size // cfg.pipeline_parallel_microbatch_size)


def build_passes(
    *,
    parts: Sequence[nn.Module],
    stages: Sequence[int],
    num_parts: int,
    loss_fn: LossFn,
    optimizers: OptimizersContainer,
    accumulation_steps: int,
    cfg: Parallelism,
    local_batch_size: int,
    mesh: DeviceMesh | None,
    device: torch.device,
) -> tuple[ForwardBackward, Evaluate]:
    """The forward-backward of this rank's `parts` (stage indices `stages` of `num_parts`),
    and their forward-only evaluation (through the same pipeline schedule).

    Args:
        parts: this rank's model parts, in stage order.
        stages: their stage indices.
        num_parts: stages of the whole model.
        loss_fn: `(outputs, labels) -> mean loss`.
        optimizers: the container; its `scale_loss` gives the loss backward runs on.
        accumulation_steps: micro-batches per optimizer step (each loss is divided by it).
        cfg: `[parallelism]` (schedule and pipeline micro-batch size).
        local_batch_size: sequences per micro-batch on this data-parallel rank.
        mesh: the job's named mesh (its "pp" dimension); None in one process.
        device: where the stages run.
    """
    if len(parts) == num_parts:
        return _sequential(parts, loss_fn, optimizers, accumulation_steps)
    if mesh is None:
        raise ValueError(f"{len(parts)} of {num_parts} model parts need a mesh with a pp dim")
    # (imported here: `torch.distributed.pipelining` brings dynamo, ~0.5 s a process)
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    pp = mesh["pp"]
    pipeline_stages = [
        PipelineStage(part, index, num_parts, device, group=pp.get_group())
        for part, index in zip(parts, stages)
    ]
    losses: list[torch.Tensor] = []
    n_micro = local_batch_size // cfg.pipeline_parallel_microbatch_size

    def stage_loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(outputs, labels) / accumulation_steps
        losses.append(loss.detach())
        # The mean over micro-batches is taken here, not by the schedule dividing gradients
        # afterwards (scale_grads): that would divide earlier accumulation steps' gradients
        # again, and come after in-backward units have stepped.
        return optimizers.scale_loss(loss / n_micro)

    kwargs = {"loss_fn": stage_loss, "scale_grads": False}
    if cfg.pipeline_parallel_schedule == "Interleaved1F1B":
        schedule = ScheduleInterleaved1F1B(pipeline_stages, n_micro, **kwargs)
    else:
        (stage,) = pipeline_stages
        single = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[cfg.pipeline_parallel_schedule]
        schedule = single(stage, n_micro, **kwargs)
    first, last = 0 in stages, num_parts - 1 in stages

    def forward_backward(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses.clear()
        args = (inputs,) if first else ()
        schedule.step(*args, target=labels if last else None, return_outputs=False)
        if not losses:
            return torch.zeros((), device=device)
        # The first step also calls the loss once on its shape-inference output: not a batch.
        return torch.stack(losses[-n_micro:]).mean()

    @torch.no_grad()
    def evaluate(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses.clear()
        args = (inputs,) if first else ()
        schedule.eval(*args, target=labels if last else None)
        if not losses:
            return torch.zeros((), device=device)
        return torch.stack(losses[-n_micro:]).mean() * accumulation_steps

    return forward_backward, evaluate


def _sequential(
    parts: Sequence[nn.Module],
    loss_fn: LossFn,
    optimizers: OptimizersContainer,
    accumulation_steps: int,
) -> tuple[ForwardBackward, Evaluate]:
    def forward(inputs: torch.Tensor) -> torch.Tensor:
        h = inputs
        for part in parts:
            h = part(h)
        return h

    def forward_backward(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(forward(inputs), labels) / accumulation_steps
        optimizers.backward(loss)
        return loss.detach()

    @torch.no_grad()
    def evaluate(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_fn(forward(inputs), labels)

    return forward_backward, evaluate
