"""Pipeline parallelism: each rank trains a contiguous slice of the model's layers.

Every rank sees the same global batch of `cfg.batch_size` rows (pipeline parallelism splits the
model, not the data); `torch.distributed.pipelining` cuts it into micro-batches and streams them
through the stages with the GPipe or 1F1B schedule. Ranks come only from the `DistContext`.
The strategy's options are in pipeline_options, cutting the model in pipeline_stages, and this
rank's stages with their schedule in pipeline_schedule; here are the checks, the step, the
evaluation across stages and reassembling the model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from flyscale.config import TrainConfig
from flyscale.plugin.strategy_protocol import StrategyTraits
from flyscale.train import meta
from flyscale.train.batches import Batches, TrainData
from flyscale.train.distributed import DistContext
from flyscale.train.objective import pairing
from flyscale.train.step import StepFn
from flyscale.train.trainer import Parallelized
from flyscale_plugins.strategies.pipeline_options import SCHEDULES, PipelineOptions
from flyscale_plugins.strategies.pipeline_schedule import LocalStage, build_stage, forward_backward
from flyscale_plugins.strategies.pipeline_stages import (
    auto_split_points,
    layers,
    refuse_running_statistics,
    sequential,
    split_bounds,
    split_model,
)

# The pieces now in pipeline_options, pipeline_stages and pipeline_schedule stay importable from here.
__all__ = [
    "SCHEDULES",
    "LocalStage",
    "Pipeline",
    "PipelineOptions",
    "assemble",
    "auto_split_points",
    "build_stage",
    "check_stages",
    "clip_global_grad_norm",
    "forward_backward",
    "layers",
    "pipeline",
    "pipeline_step",
    "refuse_running_statistics",
    "sequential",
    "split_bounds",
    "split_model",
    "stage_evaluator",
    "train_loader",
]


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
