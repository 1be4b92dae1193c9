"""Preflight: a few optimizer steps at world size N against one process, before a full run pays.

Wrong sharding, a wrong learning-rate scaling or a missing gradient all-reduce do not crash:
they train a slightly different model, and nobody notices until the metrics disappoint. Here
the configured strategy runs `steps` optimizer steps on the real worker group, and rank 0
replays the same global batches in one process with the plain single-device loop. A correct
setup computes the same math, so the losses agree to float rounding; when they do not, the
run stops with the numbers.

Why the comparison is fair:

- one global batch of training rows, one optimizer step per epoch: every epoch trains on the
  same rows at world 1 and at world N, however the sampler shards or reshuffles them, and
  `fit`'s per-epoch train loss is exactly the loss of that step (computed before its update);
- the validation loss after each epoch is the loss *after* each update, so the last step is
  checked too;
- the global batch is `batch_size x world` for strategies that shard the data (DDP) and
  `batch_size` for those whose workers all see one batch (pipeline: `per_worker_batch=False` in its traits);
  `effective_lr` scales by the global batch, so both sides use the same learning rate;
- both models start from the same seed, with dropout switched off: its masks are random
  draws that differ between one process and N, and are not what this check is about.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from flyscale.config import PreflightConfig, TrainConfig
from flyscale.train import loop, meta, trainer
from flyscale.train.batches import TrainData, make_loader
from flyscale.train.distributed import DistContext, local_world_size
from flyscale.train.evaluator import evaluate_split
from flyscale.train.step import make_optimizer, make_scheduler, standard_step
from flyscale.train.strategies import replicas
from flyscale.train.telemetry import TrainHistory, data_parallel_knobs

log = logging.getLogger(__name__)

VAL_ROWS = 256  # enough to see an update's effect; the check must stay cheap
# The loop's own logger: its per-epoch lines and input-bound diagnosis are noise for 1-step epochs.
TRAINING_LOGGERS = (loop.__name__, trainer.__name__)  # whose INFO and WARNING the preflight quiets


@dataclass
class PreflightReport:
    """What the preflight compared. `steps == 0` means it was switched off (`world_size` 0: not run)."""

    passed: bool
    world_size: int
    steps: int = 0
    strategy: str = ""
    rtol: float = 0.0
    max_rel_diff: float = 0.0
    losses_world1: list[float] = field(default_factory=list)  # train loss of each step, one process
    losses_worldN: list[float] = field(default_factory=list)  # the same steps on the worker group
    val_losses_world1: list[float] = field(default_factory=list)  # loss after each step
    val_losses_worldN: list[float] = field(default_factory=list)
    # Throughput of the same steps: one process with every thread of the node's workers, and the group.
    samples_per_s_world1: float = 0.0
    samples_per_s_worldN: float = 0.0
    grad_comm_fraction: float = 0.0  # of the group's steps, with gradient all-reduces in flight
    slower_with_workers: str = ""  # the warning, when the worker group trained slower than one process
    checked: bool = False  # whether a divergence stops the run (preflight.enabled); else only timed, for auto
    # FLYSCALE_NPROC_PER_NODE=auto in a local run: the workers training runs on (0: the launcher's
    # own count), and why, in one line for the summary.
    workers: int = 0
    workers_reason: str = ""

    @classmethod
    def skipped(cls) -> PreflightReport:
        """The report of a switched-off check: nothing compared, nothing to stop."""
        return cls(passed=True, world_size=0, steps=0)

    def table(self) -> str:
        """The per-step numbers, one row per step, as a person reads them in a log."""
        header = (
            f"{'step':>4}  {'loss@1':>12}  {'loss@' + str(self.world_size):>12}  "
            f"{'val@1':>12}  {'val@' + str(self.world_size):>12}  {'rel diff':>9}"
        )
        rows = [header]
        for i in range(self.steps):
            a, b = self.losses_world1[i], self.losses_worldN[i]
            va, vb = self.val_losses_world1[i], self.val_losses_worldN[i]
            rows.append(
                f"{i + 1:>4}  {a:>12.6f}  {b:>12.6f}  {va:>12.6f}  {vb:>12.6f}  "
                f"{max(rel_diff(a, b), rel_diff(va, vb)):>9.2e}"
            )
        return "\n".join(rows)


def rel_diff(a: float, b: float) -> float:
    """|a - b| relative to the larger magnitude (losses are positive; the floor avoids 0/0)."""
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def global_batch(strategy: Any, cfg: TrainConfig, world_size: int) -> int:
    """Rows per optimizer step across the job, by the strategy's own batch semantics."""
    return cfg.batch_size * replicas(strategy, cfg.plugin.options, world_size)


def without_dropout(model: nn.Module) -> nn.Module:
    """Dropout off in place: random masks differ between one process and N by design."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
    return model


def single_process(model: nn.Module, data: TrainData, cfg: TrainConfig, device: torch.device) -> TrainHistory:
    """The reference: the plain single-device loop, no wrapper, no collectives."""
    ctx = DistContext(device=device)
    # A model built on the meta device gets every layer's initial weights, as each stage draws its own.
    model = meta.materialise(model, device, cfg.seed).to(device)
    dataset = TensorDataset(data.x_train, data.y_train)
    loader = make_loader(dataset, ctx.train_sampler(dataset, seed=cfg.seed), cfg, ctx)
    optimizer = make_optimizer(model, cfg, world_size=1)
    scheduler = make_scheduler(optimizer, cfg, len(loader))
    step = standard_step(model, optimizer, cfg, device, scheduler, objective=data.objective)
    evaluate = evaluate_split(model, data.x_val, data.y_val, ctx, objective=data.objective)
    return trainer.fit(model, step, loader, evaluate, cfg, ctx, strategy="reference", optimizer=optimizer)


def compare(reference: TrainHistory, worker_group: TrainHistory, rtol: float, strategy: str) -> PreflightReport:
    """Line the two runs up step by step; `passed` when every loss agrees within `rtol`."""
    report = PreflightReport(
        passed=True,
        world_size=worker_group.world_size,
        steps=len(reference.epochs),
        strategy=strategy,
        rtol=rtol,
        losses_world1=[m.train_loss for m in reference.epochs],
        losses_worldN=[m.train_loss for m in worker_group.epochs],
        val_losses_world1=[m.val_loss for m in reference.epochs],
        val_losses_worldN=[m.val_loss for m in worker_group.epochs],
    )
    if len(worker_group.epochs) != report.steps:
        raise ValueError(f"preflight: the worker group ran {len(worker_group.epochs)} steps, expected {report.steps}")
    pairs = zip(report.losses_world1 + report.val_losses_world1, report.losses_worldN + report.val_losses_worldN)
    report.max_rel_diff = max(rel_diff(a, b) for a, b in pairs)
    report.passed = report.max_rel_diff <= rtol
    report.samples_per_s_world1, report.samples_per_s_worldN = _rate(reference), _rate(worker_group)
    report.grad_comm_fraction = statistics.median(m.grad_comm_fraction for m in worker_group.epochs)
    return report


def _rate(history: TrainHistory) -> float:
    """Median global samples/s of the steps after the first (which warms caches and allocators)."""
    epochs = history.epochs[1:] or history.epochs
    return statistics.median(m.samples_per_s for m in epochs)


def keep_global_batch(
    cfg: TrainConfig, report: PreflightReport, world_size: int, otherwise: str
) -> tuple[TrainConfig, str]:
    """The training config on `world_size` workers, and the summary's line on the workers. Where
    `auto` chose a count other than the group the preflight timed, each worker's batch grows or
    shrinks so that the global batch stays the one timed (the config's, at the timed count): the
    same model either way, to float rounding. `otherwise`: how the count was set, when auto did
    not choose it."""
    timed = report.world_size
    if report.workers and world_size == report.workers:
        if world_size != timed:
            cfg = dataclasses.replace(cfg, batch_size=cfg.batch_size * timed // world_size)
        return cfg, report.workers_reason
    return cfg, f"{world_size} ({otherwise})"


def slower_with_workers(report: PreflightReport, cfg: TrainConfig) -> str:
    """Say so, with the numbers and the knobs, when the worker group trains slower than one
    process given the same cores; "" otherwise."""
    one, group = report.samples_per_s_world1, report.samples_per_s_worldN
    if report.world_size < 2 or one <= 0 or group >= one:
        return ""
    return (
        f"data parallelism makes this run slower: {report.world_size} workers train {group:,.0f} samples/s against "
        f"{one:,.0f} for one process with the same cores ({group / one:.2f}x), measured over the preflight's "
        f"{report.steps} steps. Likely communication-bound at this model size and batch (gradient all-reduces in "
        "flight "
        f"{report.grad_comm_fraction:.0%} of each step). Knobs: {data_parallel_knobs(cfg)}."
    )


def choose_workers(report: PreflightReport, rows: int) -> PreflightReport:
    """`auto`: train on the faster of one process and the worker group, as the preflight timed
    them on the same global batch of `rows`, which training keeps either way."""
    one, group, n = report.samples_per_s_world1, report.samples_per_s_worldN, report.world_size
    if one > group:
        report.workers = 1
        report.workers_reason = (
            f"1 of {n} (auto: in the preflight one process trained {one:,.0f} samples/s, {n} workers {group:,.0f}; "
            f"the global batch of {rows} rows kept)"
        )
    else:
        report.workers = n
        report.workers_reason = (
            f"{n} (auto: in the preflight {n} workers trained {group:,.0f} samples/s, one process {one:,.0f})"
        )
    report.slower_with_workers = ""  # the choice answers it
    return report


def check(report: PreflightReport) -> PreflightReport:
    """Raise with the numbers when the worker group diverged from one process (only timed, for
    `auto`: say so instead)."""
    if not report.passed and not report.checked:
        log.warning(
            "the worker group's losses differ from one process's on the same batches (max relative difference "
            "%.2e > %.0e); preflight.enabled: true stops a run on this\n%s",
            report.max_rel_diff,
            report.rtol,
            report.table(),
        )
    elif not report.passed:
        raise ValueError(
            f"preflight failed: {report.strategy} at world size {report.world_size} diverges from one process "
            f"on the same global batches (max relative difference {report.max_rel_diff:.2e} > "
            f"preflight.rtol {report.rtol:.0e}). Suspect data sharding, learning-rate scaling, gradient "
            f"synchronisation, or a train setting the strategy does not apply.\n{report.table()}"
        )
    elif report.checked:
        log.info(
            "preflight passed: %d steps of %s, world size 1 vs %d, max relative difference %.2e (rtol %.0e)\n%s",
            report.steps,
            report.strategy,
            report.world_size,
            report.max_rel_diff,
            report.rtol,
            report.table(),
        )
    if report.slower_with_workers:
        log.warning("%s", report.slower_with_workers)
    return report


@contextlib.contextmanager
def quiet_training_logs() -> Iterator[None]:
    """Errors only from the training loops while the preflight drives them; our report speaks instead."""
    loggers = [logging.getLogger(name) for name in TRAINING_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def run_preflight(
    build_model: Callable[[], nn.Module],
    data: TrainData,
    cfg: TrainConfig,
    pcfg: PreflightConfig,
    ctx: DistContext,
    strategy_fn: Callable[..., Any],
    options: Any,
    choose: bool = False,
) -> PreflightReport | None:
    """Run the check on every rank of the worker group; rank 0 returns the report (others None).
    `choose` (FLYSCALE_NPROC_PER_NODE=auto, locally): the same steps time one process against
    the group, and the report says which to train on; switched off, they are timed only.

    `build_model` must build the same initial weights whenever it is called after seeding.
    """
    if not pcfg.enabled and not choose:
        return PreflightReport.skipped()
    rows = global_batch(strategy_fn, cfg, ctx.world_size)
    if len(data.y_train) < rows and not pcfg.enabled:  # only timed for auto: the launcher's count stands
        return PreflightReport(passed=True, world_size=0, workers_reason=f"too few training rows to time ({rows})")
    if len(data.y_train) < rows:
        raise ValueError(f"preflight needs {rows} training rows (one global batch), got {len(data.y_train)}")
    # One global batch and one step per epoch; DataLoader workers only cost start-up time here.
    cfg = dataclasses.replace(cfg, epochs=pcfg.steps, num_workers=0, persistent_workers=False)
    data = TrainData(
        data.x_train[:rows], data.y_train[:rows], data.x_val[:VAL_ROWS], data.y_val[:VAL_ROWS], objective=data.objective
    )
    log.info("preflight: %d steps of %s at world size %d against one process", pcfg.steps, cfg.strategy, ctx.world_size)
    with quiet_training_logs():
        torch.manual_seed(cfg.seed)
        worker_group = trainer.train(strategy_fn, without_dropout(build_model()), data, cfg, ctx, options).history
        if not ctx.is_main:
            return None
        torch.manual_seed(cfg.seed)
        ref_cfg = dataclasses.replace(cfg, batch_size=rows)  # one process takes the whole global batch
        with node_threads(ctx):  # the other workers are done: one process gets all their cores
            reference = single_process(without_dropout(build_model()), data, ref_cfg, ctx.device)
    report = compare(reference, worker_group, pcfg.rtol, cfg.strategy)
    report.checked = pcfg.enabled
    report.slower_with_workers = slower_with_workers(report, cfg)
    if choose:
        choose_workers(report, rows)
    return check(report)


@contextlib.contextmanager
def node_threads(ctx: DistContext) -> Iterator[None]:
    """This process runs with the threads of every worker on its node (CPU), then as it was."""
    before = torch.get_num_threads()
    local = local_world_size(ctx)
    if ctx.device.type == "cpu":
        torch.set_num_threads(min(os.cpu_count() or before, before * max(local, 1)))
    try:
        yield
    finally:
        torch.set_num_threads(before)
