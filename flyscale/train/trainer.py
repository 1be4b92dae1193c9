"""The training job, written once: a strategy applies its parallelism to the model
(`parallelize`), and the trainer builds the optimizer, the scheduler and the step around what it
returns, runs the epochs (`fit`) with the run's checkpoints and hooks, and hands back the whole
model.

A strategy knows its parallelism and nothing else, as in torchtitan: what it hands back is a
`Parallelized`, which says what the trainer cannot know by itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flyscale.config import TrainConfig
from flyscale.train import early_stop, strategies
from flyscale.train.batches import Batches, TrainData
from flyscale.train.distributed import DistContext, set_epoch
from flyscale.train.evaluator import EvalFn
from flyscale.train.interrupt import Interrupted, StepVote
from flyscale.train.loop import NO_HOOKS, AfterStep, Hooks, TrainResult, checked_metrics, log_epoch, train_epoch
from flyscale.train.progress import train_progress
from flyscale.train.state import Position, TrainState
from flyscale.train.step import StandardStep, StepFn, counted_once, make_optimizer, make_scheduler, standard_step
from flyscale.train.telemetry import (
    EpochMetrics,
    InFlight,
    TrainHistory,
    diagnose_epochs,
    state_bytes,
)

log = logging.getLogger(__name__)


@dataclass
class Parallelized:
    """What a strategy's `parallelize` made of the model on this rank, for the trainer to train.

    Only `name` and `module` are needed; every other field has the plain data-parallel answer as
    its default.
    """

    name: str  # the strategy, as the history and the checkpoints name it
    # What this rank holds and trains of the model: the optimizer updates its parameters, a
    # checkpoint holds its state, and the default evaluator scores it. The whole model (ddp), its
    # shards (fsdp), or this rank's stage (pipeline).
    module: nn.Module
    # What the standard step runs forward and backward through, when it wraps `module` (DDP).
    forward: nn.Module | None = None
    stage: bool = False  # `module` is some of the model's layers, not all (its checkpoint is this stage's)
    # The step, where the standard step does not do (a pipeline's schedule): made from the
    # optimizer and the scheduler (or None) the trainer built over `module`.
    step: Callable[[torch.optim.Optimizer, Any], StepFn] | None = None
    # For the standard step: skipping the gradient reduction on micro-batches before the last
    # (DDP's `no_sync`), and clipping by the global norm where torch's cannot see the whole model.
    no_sync: Callable[[], AbstractContextManager] | None = None
    clip: Callable[[float], None] | None = None
    counts: bool = True  # False: this rank's loss and rows repeat another's (a tp rank), `fit` sums them once
    evaluate: EvalFn | None = None  # validation, where scoring `module` on this rank's share does not do
    loader: Batches | None = None  # the training batches, where this rank's share of each epoch does not do
    grad_comm_seconds: Callable[[], float] | None = None  # the seconds its collectives have been in flight
    # The whole trained model on rank 0 (gathered, assembled); None: `module` is it.
    whole: Callable[[], nn.Module] | None = None


class _Run:
    """What one call of `fit` carries from step to step: the optimizer steps taken over every
    attempt, the ranks' vote on checkpoints and signals, and the checkpoints written per step."""

    def __init__(self, cfg: TrainConfig, ctx: DistContext, strategy: str, state: TrainState | None, hooks: Hooks):
        self.cfg, self.ctx, self.strategy, self.state, self.hooks = cfg, ctx, strategy, state, hooks
        self.ckpt = hooks.checkpointer if state is not None else None
        self.history = TrainHistory(strategy=strategy, world_size=ctx.world_size)
        self.position = Position()
        self.epoch = 0
        self.steps_per_epoch = 0
        self.done = 0  # optimizer steps taken so far, over every attempt
        self.vote = StepVote()
        self.voting = False

    def start(self, steps_per_epoch: int) -> None:
        """Resume where a checkpoint left off (or from the starting weights), before the first step."""
        cfg, ctx, state, ckpt, history = self.cfg, self.ctx, self.state, self.ckpt, self.history
        if self.hooks.checkpointer is not None and state is None and ctx.is_main:
            log.warning("strategy %r hands fit no TrainState: this run keeps no checkpoints", self.strategy)
        if self.hooks.start:
            if state is None:
                raise ValueError(
                    f"model.init_from needs the strategy to hand fit its TrainState; {self.strategy!r} does not"
                )
            # Before any checkpoint: one overwrites what it holds, and it holds no frozen weight
            # (LoRA's base model), which comes from the starting weights on every attempt.
            state.load_start(self.hooks.start)
        if ckpt is not None and state is not None:
            found = ckpt.restore(state, ctx, self.strategy)
            if found is not None:
                self.position, resumed = found
                history.resumed_from_step, history.resumed_from = resumed.step, f"{resumed.path} ({resumed.source})"
                if resumed.world_size != ctx.world_size:
                    history.resharded = (
                        f"resharded from {resumed.world_size} workers to {ctx.world_size} (the global batch kept: "
                        f"{cfg.batch_size} rows a worker, {cfg.grad_accum_steps} "
                        f"micro-batch{'es' if cfg.grad_accum_steps > 1 else ''} a step)"
                    )
                history.epochs = [EpochMetrics(**m) for m in self.position.history]
        if cfg.early_stopping is not None and state is None:
            raise ValueError(
                f"train.early_stopping needs the strategy to hand fit its TrainState, to keep the best epoch's "
                f"weights; strategy {self.strategy!r} does not"
            )
        self.steps_per_epoch = steps_per_epoch
        self.done = self.position.step
        # Where the ranks agree whether a checkpoint is due by time and whether a signal stops them.
        self.vote = StepVote(self.position.step)
        self.voting = self.hooks.signals is not None or (ckpt is not None and ckpt.every_seconds != 0)
        if ckpt is not None:
            ckpt.begin()

    def per_step(self) -> AfterStep | None:
        """The hook after each step; None without a checkpointer or signals to heed (one call a
        step on the hot path saved)."""
        return self.after_step if self.ckpt is not None or self.hooks.signals is not None else None

    def after_step(
        self, batch: int, losses: Callable[[], list[float]], hits: list, rows: int, wait: float, seconds: float
    ) -> None:
        """Agree on a checkpoint or a stop where a vote is due; write the checkpoint; stop."""
        ctx, ckpt, signals = self.ctx, self.ckpt, self.hooks.signals
        self.done += 1
        late = stop = False
        if self.voting and self.vote.due(self.done):
            expected = (
                self.vote.step_seconds * self.steps_per_epoch * self.cfg.epochs
            )  # the whole run, for the automatic interval
            late, stop = self.vote.cast(
                self.done,
                ctx,
                late=ckpt is not None and ckpt.overdue(expected),
                stop=signals is not None and bool(signals.received),
            )
        written = ""
        if ckpt is not None and self.state is not None and (ckpt.due(self.done, late) or (stop and ckpt.on)):
            at = Position(
                step=self.done,
                epoch=self.epoch,
                batch=batch,
                losses=losses(),
                hits=[float(v) for v in hits],
                rows=rows,
                wait=wait,
                seconds=seconds,
                history=[vars(m).copy() for m in self.history.epochs],
            )
            written = str(ckpt.save(self.state, at, ctx, self.strategy))
        if stop:
            if ckpt is not None:
                ckpt.wait()  # committed (manifest, rename) before any rank leaves
            why = signals.name() if signals is not None and signals.received else "a signal to another rank"
            if ctx.is_main:
                log.warning(
                    "%s: every rank stopped after step %d%s",
                    why,
                    self.done,
                    f"; checkpoint {written}" if written else "; no checkpoint (checkpoints are off)",
                )
            raise Interrupted(self.done, why, written, ctx.is_main)

    def end_epoch(
        self, m: EpochMetrics, val_rows: float, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> bool:
        """Record epoch `m` (`val_rows`: this rank's), keep the best epoch's weights: whether early
        stopping ends the run here."""
        cfg, ctx, state, history, stopping = self.cfg, self.ctx, self.state, self.history, self.cfg.early_stopping
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
            if not val_rows:
                raise ValueError(
                    "train.early_stopping watches the validation split, and it is empty: raise "
                    "data.val_fraction, or switch early stopping off"
                )
            verdict = early_stop.judge(history.epochs, stopping)
            if verdict.best == len(history.epochs) - 1:
                state.keep_best()
        return verdict is not None and verdict.stop

    def finish(self, stopped_by: str, clock: InFlight | None) -> TrainHistory:
        """The history, once the last epoch ran: steps, checkpoints, diagnosis, the epoch kept."""
        cfg, ctx, ckpt, state, history, stopping = (
            self.cfg,
            self.ctx,
            self.ckpt,
            self.state,
            self.history,
            self.cfg.early_stopping,
        )
        history.steps, history.steps_run = self.done, self.done - self.position.step
        if ckpt is not None:
            # The last asynchronous save committed before the model is handed on, and before the best
            # epoch's weights are put back in place of the ones it is writing.
            ckpt.wait()
            history.checkpoints_saved, history.checkpoint_seconds = len(ckpt.saved), ckpt.seconds_saving
        # From the steady epochs' medians, as the scaling study's worker advice is (telemetry.steady).
        history.diagnosis = diagnose_epochs(history.epochs, cfg, ctx.world_size, clock, self.hooks.workers_timed)
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
    run = _Run(cfg, ctx, strategy, state, hooks)
    steps_per_epoch = len(loader)
    run.start(steps_per_epoch)
    position, ckpt = run.position, run.ckpt
    stopped_by = ""  # why training ended before its last epoch, when something else than early stopping said so
    after_step = run.per_step()
    with train_progress(cfg.epochs, steps_per_epoch, main=ctx.is_main, world_size=ctx.world_size) as bar:
        comm_before = grad_comm_seconds() if grad_comm_seconds else 0.0
        for epoch in range(position.epoch, cfg.epochs):
            run.epoch = epoch
            set_epoch(loader, epoch)
            model.train()
            resume_here = position if epoch == position.epoch else None
            restore_rng = ckpt.restore_rng if ckpt is not None else None
            loss_sum, correct, count, wait, seconds, first_bad = train_epoch(
                step, loader, ctx, bar, resume_here, after_step, restore_rng
            )
            if after_step is None:  # no hook counted the steps
                run.done += steps_per_epoch - (resume_here.batch if resume_here is not None else 0)
            v_loss, v_correct, v_count = evaluate()
            comm_now = grad_comm_seconds() if grad_comm_seconds else 0.0
            grad_comm, comm_before = comm_now - comm_before, comm_now
            sums = [loss_sum, correct or 0.0, count, v_loss, v_correct, v_count, wait, grad_comm, seconds]
            m = checked_metrics(epoch, sums, first_bad, steps_per_epoch, cfg, ctx, correct is not None)
            early = run.end_epoch(m, v_count, model, optimizer)
            if bar is not None:
                bar.end_epoch(m.samples_per_s)
            if ctx.is_main:
                for listener in hooks.on_epoch:
                    listener(m)
                log_epoch(m, epoch, cfg.epochs)
            if early:  # the same metrics on every rank: all stop together
                break
            # Entered by every rank every epoch, whatever hooks it holds: `stop` lives on rank 0
            # only, and a collective entered on some ranks alone waits for the others forever.
            stopped_by = ctx.from_main(hooks.stop(m) if ctx.is_main and hooks.stop is not None else "")
            if stopped_by:
                if ctx.is_main:
                    log.info("%s", stopped_by)
                break
    return run.finish(stopped_by, grad_comm_seconds if isinstance(grad_comm_seconds, InFlight) else None)


def train(
    strategy: Any,
    model: nn.Module,
    data: TrainData,
    cfg: TrainConfig,
    ctx: DistContext,
    options: Any,
    hooks: Hooks = NO_HOOKS,
) -> TrainResult:
    """Train `model` on this rank with `strategy`; rank 0's result holds the whole trained model."""
    if not strategies.parallelizes(strategy):
        if ctx.is_main:
            log.info("strategy %s trains by itself; the parallelize form is preferred", type(strategy).__name__)
        # The preflight hands no hooks, and was never promised to: an older strategy may not take them.
        return (
            strategy(model, data, cfg, ctx, options, hooks)
            if hooks is not NO_HOOKS
            else strategy(model, data, cfg, ctx, options)
        )
    if not strategies.traits_of(strategy).meta_model:
        model = model.to(ctx.device)
    done = strategy.parallelize(model, data, cfg, ctx, options)
    loader = done.loader if done.loader is not None else data.train_loader(cfg, ctx)
    # The lr follows the global batch: the replicas that share it.
    optimizer = make_optimizer(done.module, cfg, strategies.replicas(strategy, options, ctx.world_size))
    scheduler = make_scheduler(optimizer, cfg, len(loader))
    forward = done.forward if done.forward is not None else done.module
    if done.step is not None:
        step = done.step(optimizer, scheduler)
    else:
        step = standard_step(
            forward, optimizer, cfg, ctx.device, scheduler, done.no_sync, objective=data.objective, clip=done.clip
        )
    scaler = step.scaler if isinstance(step, StandardStep) else None
    history = fit(
        forward,
        counted_once(step, done.counts),
        loader,
        done.evaluate if done.evaluate is not None else data.evaluator(done.module, ctx),
        cfg,
        ctx,
        strategy=done.name,
        optimizer=optimizer,
        grad_comm_seconds=done.grad_comm_seconds,
        state=TrainState(done.module, optimizer, scheduler, scaler, stage=done.stage),
        hooks=hooks,
    )
    return TrainResult(model=done.whole() if done.whole is not None else done.module, history=history)
