"""The single-device training loop's pieces: one epoch of steps, what the training task hands the
trainer (`Hooks`) and what it hands back (`TrainResult`). No ranks here: reductions go through
the `DistContext`, so the same loop serves one process and every strategy. The epochs around it
(`fit`) are the trainer's (flyscale/train/trainer.py)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from flyscale.config import TrainConfig
from flyscale.train.batches import Batches
from flyscale.train.checkpoint import Checkpointer
from flyscale.train.distributed import DistContext
from flyscale.train.interrupt import StopSignals
from flyscale.train.progress import TrainProgress
from flyscale.train.state import Position
from flyscale.train.step import StepFn
from flyscale.train.telemetry import EpochMetrics, TrainHistory, epoch_metrics

log = logging.getLogger(__name__)


EpochListener = Callable[[EpochMetrics], None]


@dataclass(frozen=True)
class Hooks:
    """What the training task hands a strategy, for the strategy to pass on to `fit` as it is.

    `checkpointer`: where and when `fit` checkpoints this run, and what it resumes from (None:
    no checkpoints). `on_epoch`: called on the main rank with each epoch's metrics as the epoch
    ends (the training task logs them to MLflow live). Strategies need not look inside.
    """

    checkpointer: Checkpointer | None = None
    on_epoch: tuple[EpochListener, ...] = ()
    # A state_dict file of the whole model to start from instead of the fresh weights (a warm
    # start, model.init_from); a resumed checkpoint goes further, and wins. "" = fresh weights.
    start: str = ""
    # Asked on the main rank after each epoch's listeners: a reason to stop training now (a search
    # pruning a trial that is behind), or "" to go on. Every rank stops together. Only the main
    # rank needs it (the others may hold None): `fit` shares its answer with every rank.
    stop: Callable[[EpochMetrics], str] | None = None
    # The worker count was chosen as the faster by timing (FLYSCALE_NPROC_PER_NODE=auto): the
    # diagnosis does not advise fewer workers against that measurement.
    workers_timed: bool = False
    # SIGINT/SIGTERM as this rank received them (the training task installs the handlers): the
    # ranks agree at a step boundary to stop there, checkpoint once, and raise `Interrupted`.
    signals: StopSignals | None = None


NO_HOOKS = Hooks()


@dataclass
class TrainResult:
    model: nn.Module  # the trained single-device model (unwrapped), complete on rank 0
    history: TrainHistory


class TrainingDiverged(ValueError):
    """The training or validation loss became NaN or infinite: the run stops instead of training
    on garbage, or handing on a model that predicts it."""


# After each step: (batch number in the epoch, per-step summed losses (a callable: they are
# only worked out when a checkpoint is written), hits, rows, wait s, busy s so far).
AfterStep = Callable[[int, Callable[[], list[float]], list, int, float, float], None]


def train_epoch(
    step: StepFn,
    loader: Batches,
    ctx: DistContext,
    bar: TrainProgress | None,
    position: Position | None = None,
    after_step: AfterStep | None = None,
    resumed: Callable[[], None] | None = None,
) -> tuple[float, float | None, int, float, float, int]:
    """One pass of `step` over `loader` on this rank:
    (loss sum, correct or None, rows, data wait s, seconds, first non-finite step or -1).

    Resuming (`position.batch` > 0), the batches done before the checkpoint are drawn and
    skipped, so the rest come in the order they would have, and its partial sums carry on.
    `after_step` sees where the epoch stands after every step (fit decides whether to save).
    """
    # Per-step values stay on the device as a list: no kernel per step, one reduction per epoch.
    # A step's loss is its mean over `weights[i]` rows.
    losses: list[torch.Tensor] = []
    weights: list[int] = []
    hits: list[torch.Tensor] = []
    count, wait, carried_seconds, skip = 0, 0.0, 0.0, 0
    if position is not None and position.batch:
        skip = position.batch
        losses = [torch.tensor(v, device=ctx.device) for v in position.losses]  # sums: weight 1
        weights = [1] * len(losses)
        hits = [torch.tensor(v, device=ctx.device) for v in position.hits]
        count, wait, carried_seconds = position.rows, position.wait, position.seconds
    if bar is not None:
        bar.start_epoch()
    batches = iter(loader)
    for _ in range(skip):
        next(batches)
        if bar is not None:
            bar.step(0)
    if skip and resumed is not None:
        resumed()  # the RNG as it stood when the checkpoint was written, at this very batch

    def summed() -> list[float]:
        return [float(v) * w for v, w in zip(losses, weights)]

    move = ctx.device.type != "cpu"  # batches are made on the CPU
    start = tick = time.perf_counter()
    for batch, (xb, yb) in enumerate(batches, start=skip + 1):
        wait += time.perf_counter() - tick
        if move:
            xb, yb = xb.to(ctx.device, non_blocking=True), yb.to(ctx.device, non_blocking=True)
        batch_loss, batch_correct, rows = step(xb, yb)
        losses.append(batch_loss)
        weights.append(rows)
        if batch_correct is not None:
            hits.append(batch_correct)
        count += rows
        if bar is not None:
            bar.step(len(yb))
        if after_step is not None:
            after_step(batch, summed, hits, count, wait, carried_seconds + time.perf_counter() - start)
        tick = time.perf_counter()
    per_step = torch.stack(losses) if losses else torch.zeros(0, device=ctx.device)
    # The one device sync of the epoch. A step off a pipeline's last stage has mean 0 over 0 rows.
    loss_sum = float(per_step @ torch.tensor(weights, dtype=per_step.dtype, device=ctx.device))
    first_bad = -1
    if not math.isfinite(loss_sum):
        bad = torch.nonzero(~torch.isfinite(per_step))
        first_bad = int(bad[0]) if len(bad) else -1  # -1: only the weighted sum overflowed
    # None when no step tracked accuracy: unknown is not zero, and is not logged as a number.
    correct = float(torch.stack(hits).sum()) if hits else None
    return loss_sum, correct, count, wait, carried_seconds + time.perf_counter() - start, first_bad


def diverged(epoch: int, first_bad: int, steps: int, cfg: TrainConfig, ctx: DistContext) -> TrainingDiverged:
    """The error every rank raises together when the summed loss is not finite."""
    bad = [(rank, s) for rank, s in enumerate(ctx.all_gather_object(first_bad)) if s >= 0]
    rank, first = min(bad, key=lambda rs: rs[1]) if bad else (ctx.rank, -1)
    where = f"step {first + 1} of {steps} on rank {rank}" if first >= 0 else "its last reduction"
    hints = [f"lower train.lr (now {cfg.lr:g})"]
    if cfg.grad_clip_norm == 0:
        hints.append("set train.grad_clip_norm (e.g. 1.0)")
    if cfg.precision != "fp32":
        hints.append(f"train in fp32 (train.precision is {cfg.precision!r})")
    if cfg.scale_lr:
        hints.append("check train.scale_lr, which multiplies the lr by the global batch over train.base_batch_size")
    return TrainingDiverged(
        f"training diverged in epoch {epoch + 1}, at {where}: the loss is not finite. Likely knobs: {'; '.join(hints)}."
    )


def checked_metrics(
    epoch: int, sums: list, first_bad: int, steps: int, cfg: TrainConfig, ctx: DistContext, tracked: bool
) -> EpochMetrics:
    """The epoch's metrics summed over ranks; every rank raises together when a loss is not finite."""
    m = epoch_metrics(epoch, sums, ctx, tracked)
    if not math.isfinite(m.train_loss):  # summed over ranks: every rank sees it and stops together
        raise diverged(epoch, first_bad, steps, cfg, ctx)
    if sums[5] and not math.isfinite(m.val_loss):  # the same sums on every rank: all stop together
        raise TrainingDiverged(
            f"the validation loss is not finite ({m.val_loss}) after epoch {epoch + 1}, while the training "
            f"loss is ({m.train_loss:.4f}): the model computes garbage in eval mode. Likely cause: a layer "
            f"that behaves differently there, such as BatchNorm whose running statistics are broken (as "
            f"under the pipeline strategy, where later stages see their inputs only in micro-batches); "
            f"use LayerNorm or GroupNorm, or the ddp strategy."
        )
    return m


def log_epoch(m: EpochMetrics, epoch: int, epochs: int) -> None:
    acc = f"  acc {m.train_accuracy:.4f}" if m.train_accuracy is not None else ""
    log.info(
        "epoch %d/%d  loss %.4f%s  val_loss %.4f  val_acc %.4f  %.0f samples/s  data-wait %.0f%%",
        epoch + 1,
        epochs,
        m.train_loss,
        acc,
        m.val_loss,
        m.val_accuracy,
        m.samples_per_s,
        100 * m.data_wait_fraction,
    )
