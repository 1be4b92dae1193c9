"""Data parallelism: every rank holds the whole model and a shard of each epoch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from flyscale.config import TrainConfig
from flyscale.plugin.strategy_protocol import StrategyTraits
from flyscale.train.batches import TrainData
from flyscale.train.distributed import DistContext
from flyscale.train.step import enable_activation_checkpointing
from flyscale.train.telemetry import InFlight, data_parallel_knobs
from flyscale.train.trainer import Parallelized


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
    # batch_size rows per rank (the global batch is that times the world size); its checkpoints
    # resume on another number of workers, the global batch kept.
    traits = StrategyTraits(per_worker_batch=True, reshards=True)

    def parallelize(
        self, model: nn.Module, data: TrainData, cfg: TrainConfig, ctx: DistContext, options: DDPOptions
    ) -> Parallelized:
        """`model` (on this rank's device) in DDP; every rank trains on its shard of each epoch and
        ends with the whole model."""
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(model)
        if not ctx.distributed:
            return Parallelized("ddp", model)
        # Every rank holds the same state: rank 0 alone writes it to a checkpoint.
        wrapped, grad_comm_seconds = wrap(model, cfg, ctx.device, options)
        return Parallelized("ddp", model, forward=wrapped, no_sync=wrapped.no_sync, grad_comm_seconds=grad_comm_seconds)


ddp = DDP()
