"""Data parallelism: every rank holds the whole model and a shard of each epoch."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from flyscale.config import TrainConfig
from flyscale.train.batches import Batches, TrainData
from flyscale.train.distributed import DistContext
from flyscale.train.loop import NO_HOOKS, Hooks, TrainResult, fit
from flyscale.train.state import TrainState
from flyscale.train.step import (
    enable_activation_checkpointing,
    make_optimizer,
    make_scheduler,
    standard_step,
)
from flyscale.train.telemetry import InFlight, data_parallel_knobs


def train_loader(data: TrainData, cfg: TrainConfig, ctx: DistContext) -> Batches:
    """Per-rank batches of `cfg.batch_size`; every rank gets the same count."""
    return data.train_loader(cfg, ctx)


@dataclass
class DDPOptions:
    bucket_cap_mb: float = 25.0  # gradient all-reduce bucket size
    # Gradients live inside the all-reduce buckets: no copy in or out each step, less memory.
    gradient_as_bucket_view: bool = True
    # The same graph every step: DDP can skip searching for unused parameters. Turn off for
    # models whose forward takes different paths from step to step. Ignored with gradient
    # accumulation: torch 2.13's reducer asserts when static_graph meets no_sync().
    static_graph: bool = True
    # Time every gradient all-reduce (grad_comm_fraction in MLflow). The Python callback per
    # bucket costs about 7% of a step on the digits models (bench_ddp); turn off to save it.
    time_comm: bool = True

    def __post_init__(self):
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")


def timed_allreduce() -> tuple[Callable, InFlight]:
    """A DDP comm hook (the default all-reduce), and the clock of the seconds at least one bucket
    was in flight."""
    clock = InFlight("gradient all-reduces", data_parallel_knobs)

    # No annotations: DDP checks them, and under `from __future__ import annotations` they are strings.
    def hook(_state, bucket):
        finished = clock.launched()

        def done(fut):
            finished()  # on the communication thread, when this bucket's all-reduce has finished
            return fut.value()

        return default_hooks.allreduce_hook(None, bucket).then(done)

    return hook, clock


def wrap(
    model: nn.Module, cfg: TrainConfig, device: torch.device, options: DDPOptions
) -> tuple[DistributedDataParallel, Callable[[], float] | None]:
    """`model` in DistributedDataParallel as the strategy configures it.

    Returns (wrapped model, seconds its gradient all-reduces have been in flight so far, or None
    when `options.time_comm` is off).
    """
    # DDP broadcasts rank 0's initial weights, so every rank starts from the same model.
    wrapped = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=options.bucket_cap_mb,
        gradient_as_bucket_view=options.gradient_as_bucket_view,
        static_graph=options.static_graph and cfg.grad_accum_steps == 1,
    )
    if not options.time_comm:
        return wrapped, None
    hook, grad_comm_seconds = timed_allreduce()
    wrapped.register_comm_hook(None, hook)
    return wrapped, grad_comm_seconds


class DDP:
    """Data parallelism with DistributedDataParallel (or plainly, when running alone)."""

    options_type = DDPOptions
    per_worker_batch = True  # batch_size rows per rank; the global batch is that times the world size
    reshards = True  # its checkpoints resume on another number of workers, the global batch kept

    def __call__(
        self,
        model: nn.Module,
        data: TrainData,
        cfg: TrainConfig,
        ctx: DistContext,
        options: DDPOptions,
        hooks: Hooks = NO_HOOKS,
    ) -> TrainResult:
        """Train `model` on this rank's shard of every epoch; every rank ends with the whole model."""
        return _train(model, data, cfg, ctx, options, hooks)


def _train(
    model: nn.Module, data: TrainData, cfg: TrainConfig, ctx: DistContext, options: DDPOptions, hooks: Hooks
) -> TrainResult:
    model = model.to(ctx.device)
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(model)
    wrapped: nn.Module = model
    no_sync: Callable[[], AbstractContextManager] | None = None
    grad_comm_seconds = None
    if ctx.distributed:
        ddp_model, grad_comm_seconds = wrap(model, cfg, ctx.device, options)
        wrapped, no_sync = ddp_model, ddp_model.no_sync
    loader = train_loader(data, cfg, ctx)
    optimizer = make_optimizer(model, cfg, ctx.world_size)
    scheduler = make_scheduler(optimizer, cfg, len(loader))
    step = standard_step(wrapped, optimizer, cfg, ctx.device, scheduler, no_sync, objective=data.objective)
    history = fit(
        wrapped,
        step,
        loader,
        data.evaluator(model, ctx),
        cfg,
        ctx,
        strategy="ddp",
        optimizer=optimizer,
        grad_comm_seconds=grad_comm_seconds,
        # Every rank holds the same state: rank 0 alone writes it to a checkpoint.
        state=TrainState(model, optimizer, scheduler, step.scaler),
        hooks=hooks,
    )
    return TrainResult(model=model, history=history)


ddp = DDP()
