"""The single-device training loop. No ranks here: reductions go through the `DistContext`
the strategy hands in, so the same loop serves one process, DDP and the pipeline strategy."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from flyscale.config import TrainConfig
from flyscale.distributed import DistContext, set_epoch

log = logging.getLogger(__name__)


@dataclass
class EpochMetrics:
    """One epoch, summed over every rank."""

    epoch: int
    train_loss: float
    train_accuracy: float
    val_loss: float
    val_accuracy: float
    seconds: float
    samples_per_s: float  # global training throughput


@dataclass
class TrainHistory:
    """What the training task reports besides the weights."""

    strategy: str
    world_size: int
    epochs: list[EpochMetrics] = field(default_factory=list)

    @property
    def final(self) -> EpochMetrics:
        return self.epochs[-1]


@dataclass
class TrainData:
    """Tensors for one run; features flattened, labels int64."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor


@dataclass
class TrainResult:
    model: nn.Module  # the trained single-device model (unwrapped), complete on rank 0
    history: TrainHistory


# A step trains on one batch and returns (summed loss, number correct) as 0-d tensors. They stay
# tensors until the epoch ends: a float() per step would stall a GPU on every batch.
StepFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# An evaluation returns (summed loss, number correct, count) over this rank's share of the val set.
EvalFn = Callable[[], tuple[float, float, float]]


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def standard_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> StepFn:
    """Forward, cross-entropy, backward, update: the step every data-parallel strategy shares."""

    def step(xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        optimizer.zero_grad(set_to_none=True)
        logits = model(xb)
        loss = F.cross_entropy(logits, yb)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            return loss.detach() * len(yb), (logits.argmax(1) == yb).sum()

    return step


def evaluate_split(model: nn.Module, x: torch.Tensor, y: torch.Tensor, ctx: DistContext, batch_size: int = 1024) -> EvalFn:
    """An EvalFn over this rank's disjoint share of (x, y)."""

    @torch.no_grad()
    def run() -> tuple[float, float, float]:
        was_training = model.training
        model.eval()
        idx = torch.tensor(list(ctx.eval_indices(len(y))), dtype=torch.long)
        loss_sum = correct = 0.0
        for start in range(0, len(idx), batch_size):
            sel = idx[start : start + batch_size]
            xb, yb = x[sel].to(ctx.device), y[sel].to(ctx.device)
            logits = model(xb)
            loss_sum += float(F.cross_entropy(logits, yb, reduction="sum"))
            correct += float((logits.argmax(1) == yb).sum())
        model.train(was_training)
        return loss_sum, correct, float(len(idx))

    return run


def fit(
    model: nn.Module,
    step: StepFn,
    loader: DataLoader,
    evaluate: EvalFn,
    cfg: TrainConfig,
    ctx: DistContext,
    strategy: str,
) -> TrainHistory:
    """Run `cfg.epochs` epochs of `step` over `loader`, evaluating after each."""
    history = TrainHistory(strategy=strategy, world_size=ctx.world_size)
    for epoch in range(cfg.epochs):
        set_epoch(loader, epoch)
        model.train()
        start = time.perf_counter()
        loss_t = torch.zeros((), device=ctx.device)
        correct_t = torch.zeros((), device=ctx.device, dtype=torch.long)
        count = 0
        for xb, yb in loader:
            xb, yb = xb.to(ctx.device, non_blocking=True), yb.to(ctx.device, non_blocking=True)
            batch_loss, batch_correct = step(xb, yb)
            loss_t += batch_loss
            correct_t += batch_correct
            count += len(yb)
        loss_sum, correct = float(loss_t), float(correct_t)  # one device sync per epoch
        seconds = time.perf_counter() - start
        v_loss, v_correct, v_count = evaluate()
        loss_sum, correct, count, v_loss, v_correct, v_count = ctx.all_reduce_sum(
            [loss_sum, correct, count, v_loss, v_correct, v_count]
        )
        m = EpochMetrics(
            epoch=epoch,
            train_loss=loss_sum / count,
            train_accuracy=correct / count,
            val_loss=v_loss / max(v_count, 1),
            val_accuracy=v_correct / max(v_count, 1),
            seconds=seconds,
            samples_per_s=count / seconds if seconds > 0 else 0.0,
        )
        history.epochs.append(m)
        if ctx.is_main:
            log.info(
                "epoch %d/%d  loss %.4f  acc %.4f  val_loss %.4f  val_acc %.4f  %.0f samples/s",
                epoch + 1, cfg.epochs, m.train_loss, m.train_accuracy, m.val_loss, m.val_accuracy, m.samples_per_s,
            )
    return history
