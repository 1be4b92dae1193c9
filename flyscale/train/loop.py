"""The single-device training loop. No ranks here: reductions go through the `DistContext`
the strategy hands in, so the same loop serves one process, DDP and the pipeline strategy."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from flyscale.config import TrainConfig
from flyscale.train import early_stop
from flyscale.train.batches import Batches
from flyscale.train.checkpoint import Checkpointer
from flyscale.train.distributed import DistContext, set_epoch
from flyscale.train.evaluator import EvalFn
from flyscale.train.interrupt import Interrupted, StepVote, StopSignals
from flyscale.train.progress import TrainProgress, train_progress
from flyscale.train.state import Position, TrainState
from flyscale.train.step import StepFn
from flyscale.train.telemetry import (
    EpochMetrics,
    InFlight,
    TrainHistory,
    diagnose_epochs,
    epoch_metrics,
    state_bytes,
)

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


def _train_epoch(
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


def _diverged(epoch: int, first_bad: int, steps: int, cfg: TrainConfig, ctx: DistContext) -> TrainingDiverged:
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


def fit(
    model: nn.Module,
    step: StepFn,
    loader: Batches,
    evaluate: EvalFn,
    cfg: TrainConfig,
    ctx: DistContext,
    strategy: str,
    optimizer: torch.optim.Optimizer | None = None,
    grad_comm_seconds: Callable[[], float] | None = None,
    state: TrainState | None = None,
    hooks: Hooks = NO_HOOKS,
) -> TrainHistory:
    """Run `cfg.epochs` epochs of `step` over `loader`, evaluating after each.

    `grad_comm_seconds`, if given, returns the seconds the strategy's collectives have been in
    flight so far (ddp's gradient all-reduces, fsdp's all-gathers and reduce-scatters); an
    `InFlight` clock also names them, and the knobs, for the communication-bound diagnosis. `state` (this rank's model part,
    optimizer, scheduler, scaler) lets `hooks.checkpointer` save and resume it; a strategy that
    gives none trains without checkpoints. `hooks` are the training task's, as the strategy got them.
    """
    history = TrainHistory(strategy=strategy, world_size=ctx.world_size)
    ckpt = hooks.checkpointer if state is not None else None
    if hooks.checkpointer is not None and state is None and ctx.is_main:
        log.warning("strategy %r hands fit no TrainState: this run keeps no checkpoints", strategy)
    position = Position()
    if ckpt is not None and state is not None:
        found = ckpt.restore(state, ctx, strategy)
        if found is not None:
            position, resumed = found
            history.resumed_from_step, history.resumed_from = resumed.step, f"{resumed.path} ({resumed.source})"
            if resumed.world_size != ctx.world_size:
                history.resharded = (
                    f"resharded from {resumed.world_size} workers to {ctx.world_size} (the global batch kept: "
                    f"{cfg.batch_size} rows a worker, {cfg.grad_accum_steps} "
                    f"micro-batch{'es' if cfg.grad_accum_steps > 1 else ''} a step)"
                )
            history.epochs = [EpochMetrics(**m) for m in position.history]
    stopping = cfg.early_stopping
    if stopping is not None and state is None:
        raise ValueError(
            f"train.early_stopping needs the strategy to hand fit its TrainState, to keep the best epoch's "
            f"weights; strategy {strategy!r} does not"
        )
    if hooks.start and not history.resumed_from:
        if state is None:
            raise ValueError(f"model.init_from needs the strategy to hand fit its TrainState; {strategy!r} does not")
        state.load_start(hooks.start)
    steps_per_epoch = len(loader)
    done = [position.step]  # optimizer steps taken so far, over every attempt
    # Where the ranks agree whether a checkpoint is due by time and whether a signal stops them.
    vote = StepVote(position.step)
    signals = hooks.signals
    voting = signals is not None or (ckpt is not None and ckpt.every_seconds != 0)  # else nothing to agree on
    if ckpt is not None:
        ckpt.begin()

    def after_step(
        batch: int, losses: Callable[[], list[float]], hits: list, rows: int, wait: float, seconds: float
    ) -> None:
        done[0] += 1
        late = stop = False
        if voting and vote.due(done[0]):
            expected = vote.step_seconds * steps_per_epoch * cfg.epochs  # the whole run, for the automatic interval
            late, stop = vote.cast(
                done[0],
                ctx,
                late=ckpt is not None and ckpt.overdue(expected),
                stop=signals is not None and bool(signals.received),
            )
        written = ""
        if ckpt is not None and state is not None and (ckpt.due(done[0], late) or (stop and ckpt.on)):
            at = Position(
                step=done[0],
                epoch=epoch,
                batch=batch,
                losses=losses(),
                hits=[float(v) for v in hits],
                rows=rows,
                wait=wait,
                seconds=seconds,
                history=[vars(m).copy() for m in history.epochs],
            )
            written = str(ckpt.save(state, at, ctx, strategy))
        if stop:
            if ckpt is not None:
                ckpt.wait()  # committed (manifest, rename) before any rank leaves
            why = signals.name() if signals is not None and signals.received else "a signal to another rank"
            if ctx.is_main:
                log.warning(
                    "%s: every rank stopped after step %d%s",
                    why,
                    done[0],
                    f"; checkpoint {written}" if written else "; no checkpoint (checkpoints are off)",
                )
            raise Interrupted(done[0], why, written, ctx.is_main)

    stopped_by = ""  # why training ended before its last epoch, when something else than early stopping said so
    with train_progress(cfg.epochs, steps_per_epoch, main=ctx.is_main, world_size=ctx.world_size) as bar:
        comm_before = grad_comm_seconds() if grad_comm_seconds else 0.0
        for epoch in range(position.epoch, cfg.epochs):
            set_epoch(loader, epoch)
            model.train()
            resume_here = position if epoch == position.epoch else None
            # Without a checkpointer or signals to heed no per-step hook runs (one call a step on the hot path).
            loss_sum, correct, count, wait, seconds, first_bad = _train_epoch(
                step,
                loader,
                ctx,
                bar,
                resume_here,
                after_step if ckpt is not None or signals is not None else None,
                ckpt.restore_rng if ckpt is not None else None,
            )
            if ckpt is None and signals is None:
                done[0] += steps_per_epoch - (resume_here.batch if resume_here is not None else 0)
            v_loss, v_correct, v_count = evaluate()
            comm_now = grad_comm_seconds() if grad_comm_seconds else 0.0
            grad_comm, comm_before = comm_now - comm_before, comm_now
            tracked = correct is not None
            m = epoch_metrics(
                epoch,
                [loss_sum, correct or 0.0, count, v_loss, v_correct, v_count, wait, grad_comm, seconds],
                ctx,
                tracked,
            )
            if not math.isfinite(m.train_loss):  # summed over ranks: every rank sees it and stops together
                raise _diverged(epoch, first_bad, steps_per_epoch, cfg, ctx)
            if v_count and not math.isfinite(m.val_loss):  # the same sums on every rank: all stop together
                raise TrainingDiverged(
                    f"the validation loss is not finite ({m.val_loss}) after epoch {epoch + 1}, while the training "
                    f"loss is ({m.train_loss:.4f}): the model computes garbage in eval mode. Likely cause: a layer "
                    f"that behaves differently there, such as BatchNorm whose running statistics are broken (as "
                    f"under the pipeline strategy, where later stages see their inputs only in micro-batches); "
                    f"use LayerNorm or GroupNorm, or the ddp strategy."
                )
            m.lr = optimizer.param_groups[0]["lr"] if optimizer is not None else cfg.lr
            # The whole model as this rank has it, not only the part it trains (state.module):
            # layers held in memory but not trained would count too.
            if state is not None and not history.state_mb:
                history.state_mb = [b / 2**20 for b in ctx.all_gather_object(state_bytes(model, state.optimizer))]
                if ctx.is_main:
                    log.info(
                        "parameters, gradients and optimizer state held per rank: %s MiB",
                        ", ".join(f"{mb:.2f}" for mb in history.state_mb),
                    )
            history.epochs.append(m)
            verdict = None
            if stopping is not None and state is not None:
                if not v_count:
                    raise ValueError(
                        "train.early_stopping watches the validation split, and it is empty: raise "
                        "data.val_fraction, or switch early stopping off"
                    )
                verdict = early_stop.judge(history.epochs, stopping)
                if verdict.best == len(history.epochs) - 1:
                    state.keep_best()
            if bar is not None:
                bar.end_epoch(m.samples_per_s)
            if ctx.is_main:
                for listener in hooks.on_epoch:
                    listener(m)
                acc = f"  acc {m.train_accuracy:.4f}" if m.train_accuracy is not None else ""
                log.info(
                    "epoch %d/%d  loss %.4f%s  val_loss %.4f  val_acc %.4f  %.0f samples/s  data-wait %.0f%%",
                    epoch + 1,
                    cfg.epochs,
                    m.train_loss,
                    acc,
                    m.val_loss,
                    m.val_accuracy,
                    m.samples_per_s,
                    100 * m.data_wait_fraction,
                )
            if verdict is not None and verdict.stop:  # the same metrics on every rank: all stop together
                break
            # Entered by every rank every epoch, whatever hooks it holds: `stop` lives on rank 0
            # only, and a collective entered on some ranks alone waits for the others forever.
            stopped_by = ctx.from_main(hooks.stop(m) if ctx.is_main and hooks.stop is not None else "")
            if stopped_by:
                if ctx.is_main:
                    log.info("%s", stopped_by)
                break
    history.steps, history.steps_run = done[0], done[0] - position.step
    if ckpt is not None:
        # The last asynchronous save committed before the model is handed on, and before the best
        # epoch's weights are put back in place of the ones it is writing.
        ckpt.wait()
        history.checkpoints_saved, history.checkpoint_seconds = len(ckpt.saved), ckpt.seconds_saving
    # From the steady epochs' medians, as the scaling study's worker advice is (telemetry.steady).
    clock = grad_comm_seconds if isinstance(grad_comm_seconds, InFlight) else None
    history.diagnosis = diagnose_epochs(history.epochs, cfg, ctx.world_size, clock, hooks.workers_timed)
    if stopping is not None and state is not None and history.epochs:
        kept = early_stop.judge(history.epochs, stopping).best
        if kept != len(history.epochs) - 1:
            state.restore_best()
        history.kept_epoch = kept + 1
        history.stopping = early_stop.sentence(history.epochs, stopping, cfg.epochs)
        if ctx.is_main:
            log.info("early stopping: %s", history.stopping)
    if stopped_by:
        history.stopping = stopped_by + (f"; {history.stopping.split('; ', 1)[-1]}" if history.stopping else "")
    if history.diagnosis and ctx.is_main:
        log.warning("%s", history.diagnosis)
    return history
