"""This rank's stages wrapped in the schedule that streams micro-batches through them (GPipe,
1F1B or interleaved 1F1B), and one global batch's gradients through that schedule."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineSchedule as PipelineSchedule

from flyscale.train import meta
from flyscale.train.distributed import DistContext
from flyscale.train.objective import default as default_objective
from flyscale.train.objective import pairing
from flyscale_plugins.strategies.pipeline_options import SCHEDULES, PipelineOptions
from flyscale_plugins.strategies.pipeline_stages import layers, split_bounds


@dataclass
class LocalStage:
    """This rank's slice of the model, the schedule that runs it (None when running alone), and
    the objective the last stage scores its outputs by."""

    module: nn.Sequential  # every layer this rank holds (all of its stages'), under the model's names
    schedule: PipelineSchedule | None
    is_first: bool = True  # holds the first stage: feeds the inputs
    is_last: bool = True  # holds the last stage: scores the outputs
    objective: Any = None
    # (global stage index, its layers) for each stage this rank runs, in order; one unless interleaved.
    stages: list[tuple[int, nn.Sequential]] = field(default_factory=list)
    n_stages: int = 1


def build_stage(
    model: nn.Module, ctx: DistContext, options: PipelineOptions, seed: int = 0, objective: Any = None
) -> LocalStage:
    """Cut `model` into world_size stages and wrap this rank's in a schedule.

    A model on the meta device (see flyscale.train.meta) gets storage and initial weights for this
    rank's layers only (from `seed`); the other stages stay shapes without storage here. A model
    already in memory is used as it is. `objective`: what the loss is (classification when None).
    """
    objective = objective or default_objective()
    workers = ctx.world_size if ctx.distributed else 1
    n_stages = options.stages(workers) if workers > 1 else 1
    bounds = split_bounds(model, n_stages, options.split_points)
    rank = ctx.rank if workers > 1 else 0
    mine = list(range(rank, n_stages, workers))  # rank r runs stages r, r + workers, ...
    stages = []
    for s in mine:
        meta.materialise(model, ctx.device, seed, range(bounds[s], bounds[s + 1]))
        stages.append((s, layers(model, bounds[s], bounds[s + 1]).to(ctx.device)))
    held = nn.Sequential(OrderedDict((name, layer) for _, part in stages for name, layer in part.named_children()))
    if n_stages == 1:
        return LocalStage(held, None, objective=objective, stages=stages)
    if options.schedule != "gpipe" and options.microbatches < workers:
        raise ValueError(
            f"microbatches must be >= the number of workers ({workers}) for schedule {options.schedule}, "
            f"got {options.microbatches}"
        )
    # Manual split, not tracing: slices of a Sequential are ordinary modules, and shapes are
    # inferred from the first micro-batch, so no example inputs are needed here.
    pipeline_stages = [PipelineStage(part, s, n_stages, ctx.device) for s, part in stages]
    # Mean loss per micro-batch; scale_grads divides the summed gradients by the micro-batch count,
    # which with equal micro-batches is exactly the gradient of the global batch's mean loss.
    run = SCHEDULES[options.schedule]
    schedule = run(
        pipeline_stages if options.schedule == "interleaved_1f1b" else pipeline_stages[0],
        n_microbatches=options.microbatches,
        loss_fn=objective.loss,
    )
    return LocalStage(held, schedule, mine[0] == 0, mine[-1] == n_stages - 1, objective, stages, n_stages)


def forward_backward(stage: LocalStage, xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of one global batch; (mean loss, correct) as 0-d tensors, zeros off the last stage."""
    # Tensors, not floats, like StepFn: a float() per step would stall a GPU on every batch.
    objective = stage.objective or default_objective()
    pair = pairing(objective)
    if pair is not None:  # on every stage: the first feeds the inputs, the last scores the targets
        xb, yb = pair(xb, yb)
    if stage.schedule is None:
        logits = stage.module(xb)
        loss = objective.loss(logits, yb)
        loss.backward()
        return loss.detach(), objective.score(logits.detach(), yb)[1]
    losses: list[torch.Tensor] = []
    # Only the first stage feeds inputs and only the last one sees targets; the others relay.
    args = (xb,) if stage.is_first else ()
    kwargs: dict[str, Any] = {"target": yb, "losses": losses} if stage.is_last else {}
    logits = stage.schedule.step(*args, return_outputs=stage.is_last, **kwargs)
    if not stage.is_last:
        zero = torch.zeros((), device=xb.device)
        return zero, zero.long()
    loss = torch.stack([micro.detach() for micro in losses]).mean()
    return loss, objective.score(logits.detach(), yb)[1]
