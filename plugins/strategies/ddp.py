"""Data parallelism: every rank holds the whole model and a shard of each epoch."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from flyscale.config import TrainConfig
from flyscale.distributed import DistContext
from flyscale.training import (
    TrainData, TrainResult, enable_activation_checkpointing, evaluate_split, fit, make_loader, make_optimizer,
    make_scheduler, standard_step,
)


def train_loader(data: TrainData, cfg: TrainConfig, ctx: DistContext) -> DataLoader:
    """Per-rank batches of `cfg.batch_size`; the sampler gives every rank the same count."""
    dataset = TensorDataset(data.x_train, data.y_train)
    return make_loader(dataset, ctx.train_sampler(dataset, seed=cfg.seed), cfg, ctx)


@dataclass
class DDPOptions:
    bucket_cap_mb: float = 25.0  # gradient all-reduce bucket size
    # Gradients live inside the all-reduce buckets: no copy in or out each step, less memory.
    gradient_as_bucket_view: bool = True
    # The same graph every step: DDP can skip searching for unused parameters. Turn off for
    # models whose forward takes different paths from step to step. Ignored with gradient
    # accumulation: torch 2.13's reducer asserts when static_graph meets no_sync().
    static_graph: bool = True

    def __post_init__(self):
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")


def ddp(model: nn.Module, data: TrainData, cfg: TrainConfig, ctx: DistContext, options: DDPOptions) -> TrainResult:
    """Train with DistributedDataParallel (or plainly, when running alone)."""
    model = model.to(ctx.device)
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(model)
    wrapped: nn.Module = model
    no_sync = None
    if ctx.distributed:
        # DDP broadcasts rank 0's initial weights, so every rank starts from the same model.
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        wrapped = DistributedDataParallel(
            model,
            device_ids=device_ids,
            bucket_cap_mb=options.bucket_cap_mb,
            gradient_as_bucket_view=options.gradient_as_bucket_view,
            static_graph=options.static_graph and cfg.grad_accum_steps == 1,
        )
        no_sync = wrapped.no_sync
    loader = train_loader(data, cfg, ctx)
    optimizer = make_optimizer(model, cfg, ctx.world_size)
    scheduler = make_scheduler(optimizer, cfg, len(loader))
    history = fit(
        wrapped,
        standard_step(wrapped, optimizer, cfg, ctx.device, scheduler, no_sync),
        loader,
        evaluate_split(model, data.x_val, data.y_val, ctx),
        cfg,
        ctx,
        strategy="ddp",
        optimizer=optimizer,
    )
    return TrainResult(model=model, history=history)


ddp.options_type = DDPOptions  # type: ignore[attr-defined]
ddp.per_worker_batch = True  # type: ignore[attr-defined]  # batch_size rows per rank; the global batch is x world
