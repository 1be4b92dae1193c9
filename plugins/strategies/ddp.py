"""Data parallelism: every rank holds the whole model and a shard of each epoch."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from flyscale.config import TrainConfig
from flyscale.distributed import DistContext
from flyscale.training import TrainData, TrainResult, evaluate_split, fit, make_optimizer, standard_step


def train_loader(data: TrainData, cfg: TrainConfig, ctx: DistContext) -> DataLoader:
    """Per-rank batches of `cfg.batch_size`; the sampler gives every rank the same count."""
    dataset = TensorDataset(data.x_train, data.y_train)
    sampler = ctx.train_sampler(dataset, seed=cfg.seed)
    return DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, drop_last=False)


@dataclass
class DDPOptions:
    bucket_cap_mb: float = 25.0  # gradient all-reduce bucket size

    def __post_init__(self):
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")


def ddp(model: nn.Module, data: TrainData, cfg: TrainConfig, ctx: DistContext, options: DDPOptions) -> TrainResult:
    """Train with DistributedDataParallel (or plainly, when running alone)."""
    model = model.to(ctx.device)
    wrapped: nn.Module = model
    if ctx.distributed:
        # DDP broadcasts rank 0's initial weights, so every rank starts from the same model.
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=options.bucket_cap_mb)
    optimizer = make_optimizer(model, cfg)
    history = fit(
        wrapped,
        standard_step(wrapped, optimizer),
        train_loader(data, cfg, ctx),
        evaluate_split(model, data.x_val, data.y_val, ctx),
        cfg,
        ctx,
        strategy="ddp",
    )
    return TrainResult(model=model, history=history)


ddp.options_type = DDPOptions  # type: ignore[attr-defined]
