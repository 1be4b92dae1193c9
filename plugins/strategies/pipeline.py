"""Pipeline parallelism: each rank trains a contiguous slice of the model's layers.

Every rank sees the same global batch of `cfg.batch_size` rows (pipeline parallelism splits the
model, not the data); `torch.distributed.pipelining` cuts it into micro-batches and streams them
through the stages with the GPipe or 1F1B schedule. Ranks come only from the `DistContext`.
One strategy, one module (about 300 lines): cutting the model, the schedule, the step, the
evaluation across stages and reassembling the model all share the stage boundaries.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import _PipelineSchedule as PipelineSchedule

from flyscale.config import TrainConfig
from flyscale.plugin.contracts import StrategyTraits
from flyscale.train import meta
from flyscale.train.batches import Batches, TrainData
from flyscale.train.distributed import DistContext
from flyscale.train.objective import default as default_objective
from flyscale.train.objective import pairing
from flyscale.train.step import StepFn
from flyscale.train.trainer import Parallelized

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


@dataclass
class PipelineOptions:
    # "gpipe" (fill, drain), "1f1b" (less activation memory), or "interleaved_1f1b": each rank holds
    # `stages_per_rank` stages (rank r the r-th, the (r + workers)-th, ...), a smaller bubble for
    # more sends.
    schedule: str = "gpipe"
    microbatches: int = 4  # micro-batches per global batch; must divide train.batch_size
    split_points: list[int] = field(default_factory=list)  # layer index where each later stage starts; [] = balance
    stages_per_rank: int = 2  # interleaved_1f1b only

    def stages(self, workers: int) -> int:
        """How many stages the model is cut into on `workers` ranks."""
        return workers * (self.stages_per_rank if self.schedule == "interleaved_1f1b" else 1)

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not isinstance(self.stages_per_rank, int) or self.stages_per_rank < 1:
            raise ValueError(f"stages_per_rank must be an integer >= 1, got {self.stages_per_rank!r}")
        if not isinstance(self.microbatches, int) or self.microbatches <= 0:
            raise ValueError(f"microbatches must be an integer > 0, got {self.microbatches!r}")
        points = self.split_points
        if any(not isinstance(p, int) or p < 1 for p in points):
            raise ValueError(f"split_points must be layer indices >= 1, got {points}")
        if any(b <= a for a, b in zip(points, points[1:])):
            raise ValueError(f"split_points must be strictly increasing, got {points}")


def auto_split_points(model: nn.Sequential, n_stages: int) -> list[int]:
    """Cut points minimising the largest stage's parameter count, then its layer count."""
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in model]
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = (float("inf"), float("inf"))
    # best[j][i]: the smallest possible (params, layers) of the heaviest stage when layers[:i]
    # form j stages. A bottleneck DP is exact here because max() is monotone in each argument.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0, 0)
    for j in range(1, n_stages + 1):
        for i in range(j, n + 1):
            for p in range(j - 1, i):
                cand = max(best[j - 1][p], (prefix[i] - prefix[p], i - p))
                if cand < best[j][i]:
                    best[j][i], cut[j][i] = cand, p
    points, i = [], n
    for j in range(n_stages, 1, -1):
        i = cut[j][i]
        points.append(i)
    return points[::-1]


def sequential(model: nn.Module) -> nn.Sequential:
    """`model`, which the pipeline strategy cuts between layers: it must be an nn.Sequential."""
    if not isinstance(model, nn.Sequential):
        raise ValueError(
            f"the pipeline strategy cuts the model between its layers, so it needs an nn.Sequential, and this "
            f"one is a {type(model).__name__}: build it as an nn.Sequential of whole layers, or use train.strategy: ddp"
        )
    return model


def layers(model: nn.Module, start: int, stop: int) -> nn.Sequential:
    """Layers start:stop of `model`, with their names ("3.weight"): a Sequential's slice is one."""
    return cast(nn.Sequential, sequential(model)[start:stop])


def refuse_running_statistics(model: nn.Module) -> None:
    """Refuse layers whose running statistics the pipeline cannot keep right: a later stage sees
    its inputs only as micro-batches during the schedule (BatchNorm's mean and variance went to
    about -2e19 and inf, and every validation loss to NaN)."""
    norms = [
        f"{name} ({type(m).__name__})"
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]
    if norms:
        raise ValueError(
            f"the pipeline strategy cannot keep BatchNorm's running statistics right, and the model has "
            f"{', '.join(norms)}: use LayerNorm or GroupNorm in the model, BatchNorm with "
            f"track_running_stats=False, or train.strategy: ddp"
        )


def split_bounds(model: nn.Module, n_stages: int, split_points: list[int]) -> list[int]:
    """[0, *cut points, len(model)]: stage k is layers bounds[k]:bounds[k+1] of `model`."""
    model = sequential(model)
    if len(model) < n_stages:
        raise ValueError(f"a model of {len(model)} layers cannot be split into {n_stages} pipeline stages")
    if not split_points:
        split_points = auto_split_points(model, n_stages)
    elif len(split_points) != n_stages - 1:
        raise ValueError(
            f"split_points must name exactly {n_stages - 1} point(s) for {n_stages} stages (the world size, times "
            f"stages_per_rank under interleaved_1f1b), "
            f"got {split_points}"
        )
    bounds = [0, *split_points, len(model)]
    if any(not 0 < p < len(model) for p in split_points) or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"split_points must be strictly increasing in [1, {len(model) - 1}], got {split_points}")
    stage_of = lambda layer: next(k for k, b in enumerate(bounds[1:]) if layer < b)  # noqa: E731
    for (i, a_name), (j, b_name) in meta.shared_parameters(model):
        if stage_of(i) != stage_of(j):  # each stage would train its own copy: the weights would drift apart
            raise ValueError(
                f"layers {i} ({a_name}) and {j} ({b_name}) share one parameter (tied weights) but fall in stages "
                f"{stage_of(i)} and {stage_of(j)}: untie them (for flyscale's gpt: model.options.tie_embeddings: "
                f"false), or use train.strategy: ddp"
            )
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        # A stage without parameters does no learning and would hand AdamW an empty list.
        if not any(p.requires_grad for p in model[a:b].parameters()):
            raise ValueError(f"split_points {bounds[1:-1]} leave stage {k} ({model[a:b]}) without trainable parameters")
    return bounds


def split_model(model: nn.Module, n_stages: int, split_points: list[int]) -> list[nn.Sequential]:
    """The stages as slices of `model`: they share its parameters and keep its layer names."""
    bounds = split_bounds(model, n_stages, split_points)
    return [layers(model, a, b) for a, b in zip(bounds, bounds[1:])]


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


def stage_evaluator(stage: LocalStage, data: TrainData, ctx: DistContext) -> Callable[[], tuple[float, float, float]]:
    """Validation through the stages: activations travel stage to stage (rank to rank, and round
    again when a rank holds several), the last stage scores them.

    No rank ever holds the whole model. Every rank reads every validation row (like training,
    the first stage as inputs, the last as labels); only the last returns non-zero sums, so the
    sums over ranks that `fit` takes are exact.
    """

    objective = data.objective
    pair = pairing(objective)

    @torch.no_grad()
    def run() -> tuple[float, float, float]:
        stage.module.eval()
        loss_sum = correct = count = 0.0
        for xb, yb in data.val_batches():
            if pair is not None:
                xb, yb = pair(xb, yb)
            for s, part in stage.stages:  # stage s's input comes from the rank holding s - 1
                h = xb.to(ctx.device) if s == 0 else ctx.recv_tensor((s - 1) % ctx.world_size)
                h = part(h)
                if s < stage.n_stages - 1:
                    ctx.send_tensor(h, (s + 1) % ctx.world_size)
                    continue
                batch_loss, batch_correct, n = objective.score(h, yb.to(ctx.device))
                loss_sum, correct, count = loss_sum + float(batch_loss), correct + float(batch_correct), count + n
        stage.module.train()
        return loss_sum, correct, count

    return run


def assemble(model: nn.Module, stage: LocalStage, ctx: DistContext) -> nn.Module:
    """The whole trained model on rank 0, from every rank's stage; other ranks' `model` stays partial."""
    # CPU copies: an object gathered over NCCL would otherwise unpickle onto the sender's GPU.
    own = {k: v.detach().cpu() for k, v in stage.module.state_dict().items()}
    parts = ctx.gather_object(own)
    if not ctx.is_main:
        return model
    merged: dict[str, torch.Tensor] = {}
    for part in parts:  # a stage keeps the model's layer names ("3.weight"), so the parts fit together as they are
        merged.update(part)
    # assign=True: the meta layers take the received tensors as their storage, no copy of an empty model first.
    model.load_state_dict(merged, assign=True)
    return model.to(ctx.device)


def train_loader(data: TrainData, cfg: TrainConfig, ctx: DistContext) -> Batches:
    """Global batches in the same order on every rank; the last partial batch is dropped."""
    # Not sharded: every stage must see the same rows, the first as inputs and the last as targets.
    # drop_last: the schedule's receive buffers have a fixed micro-batch shape.
    return data.train_loader(cfg, ctx, shard=False, drop_last=True)


def _check_config(cfg: TrainConfig, options: PipelineOptions) -> None:
    _unsupported(cfg)
    if cfg.batch_size % options.microbatches:
        raise ValueError(
            f"train.batch_size ({cfg.batch_size}) must be divisible by train.options.microbatches "
            f"({options.microbatches}) for the pipeline strategy"
        )


def check_stages(model: nn.Module, cfg: TrainConfig, options: PipelineOptions, workers: int) -> None:
    """Refuse a model that does not cut into the stages `workers` ranks run (an nn.Sequential with
    trainable layers in each, no running statistics, no tie across stages), or a config the
    stages cannot apply."""
    _check_config(cfg, options)
    refuse_running_statistics(model)
    if workers > 1:
        meta.check_untied(model, "the pipeline strategy would put them on different stages")
    split_bounds(model, options.stages(workers) if workers > 1 else 1, options.split_points)


def _check_batches(data: TrainData, cfg: TrainConfig, options: PipelineOptions) -> None:
    _check_config(cfg, options)
    if data.train_rows < cfg.batch_size:
        raise ValueError(f"train.batch_size ({cfg.batch_size}) exceeds the {data.train_rows} training rows")


def _unsupported(cfg: TrainConfig) -> None:
    """Settings this strategy does not apply yet: refuse them rather than silently ignore them."""
    for name, off in (("grad_accum_steps", 1), ("precision", "fp32"), ("activation_checkpointing", False)):
        if getattr(cfg, name) != off:
            raise ValueError(
                f"train.{name}={getattr(cfg, name)!r} is not supported by the pipeline strategy "
                f"(micro-batching already bounds activation memory); set it to {off!r} or use strategy 'ddp'"
            )


def clip_global_grad_norm(stage: LocalStage, max_norm: float, ctx: DistContext) -> None:
    """Clip by the norm of the WHOLE model's gradient, though each rank holds one stage of it.

    Clipping each stage by its own norm would be a different (and wrong) update.
    """
    grads = [p.grad for p in stage.module.parameters() if p.grad is not None]
    local_sq = float(sum(g.detach().pow(2).sum() for g in grads)) if grads else 0.0
    total = ctx.all_reduce_sum([local_sq])[0] ** 0.5
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)


def pipeline_step(
    stage: LocalStage, optimizer: torch.optim.Optimizer, cfg: TrainConfig, ctx: DistContext, scheduler
) -> StepFn:
    """One optimizer step on one global batch, for this rank's stage."""

    def step(xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        optimizer.zero_grad(set_to_none=True)
        loss, correct = forward_backward(stage, xb, yb)
        if cfg.grad_clip_norm > 0:
            clip_global_grad_norm(stage, cfg.grad_clip_norm, ctx)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        # Every stage saw the same rows; only the last one accounts for them (it has the loss).
        return loss, correct, len(yb) if stage.is_last or stage.schedule is None else 0

    return step


class Pipeline:
    """Pipeline parallelism over world_size stages (or plainly, when running alone).

    Give it the model on the meta device (the training task does, as `meta_model` asks) and each
    rank materialises, trains and holds the optimizer state of its own stage only; rank 0 puts
    the whole model together once, at the end.
    """

    options_type = PipelineOptions
    # `train.batch_size` is the global batch: every stage sees it (the preflight needs to know).
    # Each rank materialises its stage; its checkpoints resume on another number of stages.
    traits = StrategyTraits(per_worker_batch=False, meta_model=True, reshards=True)

    def parallelize(
        self, model: nn.Module, data: TrainData, cfg: TrainConfig, ctx: DistContext, options: PipelineOptions
    ) -> Parallelized:
        """This rank's stage of `model`, stepped by the schedule; rank 0 ends with the whole model."""
        _check_batches(data, cfg, options)
        refuse_running_statistics(model)
        stage = build_stage(model, ctx, options, seed=cfg.seed, objective=data.objective)
        alone = stage.schedule is None
        # Each rank checkpoints its own stage and that stage's optimizer state (no rank holds all).
        return Parallelized(
            "pipeline",
            stage.module,
            stage=not alone,
            step=lambda optimizer, scheduler: pipeline_step(stage, optimizer, cfg, ctx, scheduler),
            evaluate=None if alone else stage_evaluator(stage, data, ctx),
            loader=train_loader(data, cfg, ctx),
            whole=(lambda: model) if alone else lambda: assemble(model, stage, ctx),
        )

    def check(self, model: nn.Module, cfg: TrainConfig, options: PipelineOptions, world_size: int) -> None:
        """Before any data work: the model cuts into `world_size` stages (an nn.Sequential, with
        trainable layers in each), keeps no running statistics, and the config is one this
        strategy applies."""
        check_stages(model, cfg, options, world_size)


pipeline = Pipeline()
