"""The single-device training loop. No ranks here: reductions go through the `DistContext`
the strategy hands in, so the same loop serves one process, DDP and the pipeline strategy."""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import resource
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler, TensorDataset

from flyscale.checkpoint import Checkpointer, Position, TrainState
from flyscale.config import TrainConfig
from flyscale.distributed import DistContext, sampler_order, set_epoch
from flyscale.evaluation import batch_score
from flyscale.progress import TrainProgress, train_progress
from flyscale.step import StepFn
from flyscale.streaming import Stream, StreamingShards, evaluate_units, unit_batches

log = logging.getLogger(__name__)

DATA_WAIT_WARNING = 0.3  # above this share of step time spent waiting for data, say so
# Above this share of step time with gradient all-reduces in flight, say so. Measured on 2 cores
# (bench_data_parallel): 0.1 where 2 workers matched one process, 0.3 where they ran at 0.8x
# of it, 0.55 on the digits MLP, where they ran at 0.23x.
COMM_WARNING = 0.25


@dataclass
class EpochMetrics:
    """One epoch, summed over every rank."""

    epoch: int
    train_loss: float
    train_accuracy: float | None  # None unless train.track_train_accuracy: not measured, not zero
    val_loss: float
    val_accuracy: float
    seconds: float
    samples_per_s: float  # global training throughput
    lr: float = 0.0
    data_wait_fraction: float = 0.0  # share of the epoch spent waiting for the next batch
    compute_fraction: float = 0.0  # share spent in forward/backward/optimizer (incl. overlapped comm)
    comm_fraction: float = 0.0  # share spent in collectives outside the step (metric reductions)
    # Share of the epoch with gradient all-reduces in flight (DDP). They overlap backward, so this
    # is how busy the network was, not time added to the step.
    grad_comm_fraction: float = 0.0
    peak_memory_mb: float = 0.0  # max over ranks: CUDA allocator peak, else process max RSS

    def per_epoch(self) -> dict[str, float | None]:
        """The metrics MLflow charts per epoch, by their MLflow names (None: not measured)."""
        return {
            "train_loss": self.train_loss, "train_accuracy": self.train_accuracy, "val_loss": self.val_loss,
            "val_accuracy": self.val_accuracy, "epoch_seconds": self.seconds, "samples_per_s": self.samples_per_s,
            "lr": self.lr, "data_wait_fraction": self.data_wait_fraction, "compute_fraction": self.compute_fraction,
            "comm_fraction": self.comm_fraction, "grad_comm_fraction": self.grad_comm_fraction,
            "peak_memory_mb": self.peak_memory_mb,
        }


@dataclass
class TrainHistory:
    """What the training task reports besides the weights."""

    strategy: str
    world_size: int
    epochs: list[EpochMetrics] = field(default_factory=list)
    diagnosis: str = ""  # e.g. "input pipeline bound: raise train.num_workers"
    mlflow_run_id: str = ""  # the MLflow run rank 0 logged these epochs to while training ("" = none)
    steps: int = 0  # optimizer steps the model has taken, over every attempt
    steps_run: int = 0  # of those, the steps this (last) attempt computed
    resumed_from_step: int = 0  # the checkpoint's step this attempt resumed from (0: a fresh start)
    resumed_from: str = ""  # that checkpoint's path and where it came from ("" = a fresh start)
    checkpoints_saved: int = 0  # in this attempt
    checkpoint_seconds: float = 0.0  # rank 0's wall time spent writing them
    # Per rank, the MiB of parameters, gradients and optimizer state it holds to train (after the
    # first epoch of this attempt, when all three exist); empty where the strategy gave no TrainState.
    state_mb: list[float] = field(default_factory=list)


EpochListener = Callable[[EpochMetrics], None]
_listeners: list[EpochListener] = []


_checkpointers: list[Checkpointer] = []


@contextlib.contextmanager
def checkpointing(checkpointer: Checkpointer) -> Iterator[None]:
    """Checkpoint (and first resume) every `fit` the block runs, as `checkpointer` says. The
    training task sets it; strategies only hand `fit` their TrainState."""
    _checkpointers.append(checkpointer)
    try:
        yield
    finally:
        _checkpointers.remove(checkpointer)


@contextlib.contextmanager
def on_epoch(listener: EpochListener) -> Iterator[None]:
    """Call `listener` with each epoch's metrics on the main rank while the block runs (the
    training task logs them to MLflow live). Strategies need not know: `fit` calls it."""
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)


@dataclass
class TrainData:
    """The training and validation data of one run; features flattened, labels int64.

    In memory, the tensors hold the splits. Streamed (`stream` set, for data larger than memory),
    batches come from Parquet row groups and the tensors hold only a first slice of each split,
    for checks such as the preflight. Strategies ask for their loader and evaluation here, so
    they work the same on both.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    stream: Stream | None = None

    def train_loader(self, cfg: TrainConfig, ctx: DistContext, *, shard: bool = True,
                     drop_last: bool = False) -> DataLoader | TensorBatches:
        """Batches of `cfg.batch_size`: this rank's share (`shard`), or the same batches on every rank.

        In memory and without worker processes, batches are sliced from the tensors; the
        DataLoader serves streamed data and `train.num_workers > 0`.
        """
        world, rank = (ctx.world_size, ctx.rank) if shard else (1, 0)
        if self.stream is not None:
            dataset = StreamingShards(
                self.stream.train, self.stream.features, self.stream.label, cfg.batch_size, rank=rank, world=world,
                workers=cfg.num_workers, seed=cfg.seed, buffer_rows=self.stream.buffer_rows,
            )
            return DataLoader(
                dataset, batch_size=None, num_workers=cfg.num_workers,
                pin_memory=cfg.pin_memory and ctx.device.type == "cuda",
                persistent_workers=cfg.persistent_workers and cfg.num_workers > 0,
                prefetch_factor=cfg.prefetch_factor if cfg.num_workers > 0 else None,
                multiprocessing_context=worker_context(cfg.num_workers),
            )
        dataset = TensorDataset(self.x_train, self.y_train)
        if shard:
            sampler = ctx.train_sampler(dataset, seed=cfg.seed)
        else:  # every rank the same rows in the same order; set_epoch reseeds it identically everywhere
            sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(cfg.seed))
        if cfg.num_workers == 0:
            return TensorBatches(self.x_train, self.y_train, sampler, cfg.batch_size, drop_last)
        return make_loader(dataset, sampler, cfg, ctx, drop_last=drop_last)

    def evaluator(self, model: nn.Module, ctx: DistContext) -> EvalFn:
        """Loss and accuracy over this rank's disjoint share of the validation split."""
        if self.stream is None:
            return evaluate_split(model, self.x_val, self.y_val, ctx)
        s = self.stream
        return lambda: evaluate_units(model, s.val, s.features, s.label, ctx.rank, ctx.world_size, ctx.device)

    def val_batches(self, batch_size: int = 1024) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every validation row, in order, in batches (CPU tensors): the same on every rank."""
        if self.stream is None:
            for start in range(0, len(self.y_val), batch_size):
                yield self.x_val[start : start + batch_size], self.y_val[start : start + batch_size]
            return
        yield from unit_batches(self.stream.val, self.stream.features, self.stream.label, batch_size)

    @property
    def train_rows(self) -> int:
        return sum(u.rows for u in self.stream.train) if self.stream is not None else len(self.y_train)


class TensorBatches:
    """In-memory batches by slicing, in the order `sampler` gives: one gather per GATHER_BYTES of
    rows, each batch a view of it.

    A DataLoader over a TensorDataset fetches each row by itself and collates them: on the
    default MLP that made an epoch 1.2x as long (benchmarks/bench_trainer.py). The order (and
    a DistributedSampler's padding) is the sampler's, so the batches, and the trained weights,
    are the same as the DataLoader's.
    `set_epoch` reseeds `sampler` as it would a DataLoader's.
    """

    dataset = None  # what distributed.set_epoch looks at first: nothing here reshuffles itself
    GATHER_BYTES = 64 * 2**20

    def __init__(self, x: torch.Tensor, y: torch.Tensor, sampler: Sampler, batch_size: int, drop_last: bool = False):
        self.x, self.y, self.sampler, self.batch_size, self.drop_last = x, y, sampler, batch_size, drop_last

    def __len__(self) -> int:
        n = len(self.sampler)  # type: ignore[arg-type]
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = sampler_order(self.sampler)
        end = len(self) * self.batch_size if self.drop_last else len(order)
        # Gathered GATHER_BYTES at a time, every batch a view of that copy: a gather per batch
        # allocates and fills a fresh tensor on every step, and on the digits MLP made an epoch
        # 4% slower than gathering it whole (benchmarks/bench_trainer.py). The copy stays bounded
        # however large the data: as many batches as GATHER_BYTES hold, one at least.
        row_bytes = max(1, self.x[:1].nbytes + self.y[:1].nbytes)
        rows = self.batch_size * max(1, self.GATHER_BYTES // (row_bytes * self.batch_size))
        for start in range(0, end, rows):
            idx = order[start : min(start + rows, end)]
            xs, ys = self.x.index_select(0, idx), self.y.index_select(0, idx)
            for i in range(0, len(idx), self.batch_size):
                yield xs[i : i + self.batch_size], ys[i : i + self.batch_size]


@dataclass
class TrainResult:
    model: nn.Module  # the trained single-device model (unwrapped), complete on rank 0
    history: TrainHistory


# An evaluation returns (summed loss, number correct, count) over this rank's share of the val set.
EvalFn = Callable[[], tuple[float, float, float]]


def make_loader(dataset: Dataset, sampler: Sampler | None, cfg: TrainConfig, ctx: DistContext, drop_last: bool = False) -> DataLoader:
    """A DataLoader with the configured knobs; pinning only where it helps (CUDA)."""
    workers = cfg.num_workers
    return DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        drop_last=drop_last,
        num_workers=workers,
        pin_memory=cfg.pin_memory and ctx.device.type == "cuda",
        persistent_workers=cfg.persistent_workers and workers > 0,
        prefetch_factor=cfg.prefetch_factor if workers > 0 else None,
        multiprocessing_context=worker_context(workers),
    )


def worker_context(workers: int) -> str | None:
    """Fork DataLoader workers where the OS can.

    torch-elastic spawns the training processes, and a spawned process spawns its own children
    by default: each DataLoader worker would re-import torch and flyscale, every epoch unless
    workers persist (4 s an epoch on 2 cores, measured). Forking is what DataLoader does in a
    plain Linux process; the workers only read data and never touch the accelerator.
    """
    if workers == 0 or "fork" not in multiprocessing.get_all_start_methods():
        return None
    return "fork"


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
            batch_loss, batch_correct = batch_score(model(xb), yb)
            loss_sum, correct = loss_sum + batch_loss, correct + batch_correct
        model.train(was_training)
        return loss_sum, correct, float(len(idx))

    return run


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of `module`'s parameters, their gradients and `optimizer`'s state held in memory
    (meta tensors hold none; a storage shared by several tensors counts once)."""
    tensors = [t for p in module.parameters() for t in (p, p.grad) if t is not None]
    if optimizer is not None:
        tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if not t.is_meta}
    return sum(storages.values())


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: the allocator's peak. CPU: this process's peak resident memory.

    On Linux that is VmHWM, which starts afresh in every new program; getrusage's ru_maxrss
    would not do: a worker inherits its launcher's peak through fork and exec.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux, bytes on macOS


def data_parallel_knobs(cfg: TrainConfig) -> str:
    """What to turn when data parallelism spends its time communicating."""
    return (f"a larger batch per worker (train.batch_size, now {cfg.batch_size}), fewer workers "
            f"(FLYSCALE_NPROC_PER_NODE), or larger gradient buckets (train.options.bucket_cap_mb)")


def diagnose(m: EpochMetrics, cfg: TrainConfig, world_size: int = 1) -> str:
    """Name the knob to turn when the input pipeline or the gradients' all-reduce, not the
    model, sets the pace; "" when neither does."""
    found = []
    if m.data_wait_fraction >= DATA_WAIT_WARNING:
        hint = (
            f"raise train.num_workers (now {cfg.num_workers})" if cfg.num_workers == 0
            else "raise train.num_workers or train.prefetch_factor, or set train.persistent_workers"
        )
        found.append(f"input-bound: {m.data_wait_fraction:.0%} of each epoch waits for data, "
                     f"so the accelerator idles; {hint}")
    if world_size > 1 and m.grad_comm_fraction >= COMM_WARNING:
        found.append(
            f"communication-bound: gradient all-reduces are in flight {m.grad_comm_fraction:.0%} of each step on "
            f"{world_size} workers ({m.samples_per_s:,.0f} samples/s), so at this model size and batch one process "
            f"with the same cores may train faster; preflight.enabled: true measures both and says. Knobs: "
            f"{data_parallel_knobs(cfg)}"
        )
    return "; ".join(found)


class TrainingDiverged(ValueError):
    """The training loss became NaN or infinite: the run stops instead of training on garbage."""


# After each step: (batch number in the epoch, per-step summed losses (a callable: they are
# only worked out when a checkpoint is written), hits, rows, wait s, busy s so far).
AfterStep = Callable[[int, Callable[[], list[float]], list, int, float, float], None]


def _train_epoch(
    step: StepFn, loader: DataLoader, ctx: DistContext, bar: TrainProgress | None,
    position: Position | None = None, after_step: AfterStep | None = None, resumed: Callable[[], None] | None = None,
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
    bad = [(rank, s) for rank, s in enumerate(ctx.all_gather_object(first_bad)) if s >= 0]  # type: ignore[operator]
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
        f"training diverged in epoch {epoch + 1}, at {where}: the loss is not finite. "
        f"Likely knobs: {'; '.join(hints)}."
    )


def fit(
    model: nn.Module,
    step: StepFn,
    loader: DataLoader,
    evaluate: EvalFn,
    cfg: TrainConfig,
    ctx: DistContext,
    strategy: str,
    optimizer: torch.optim.Optimizer | None = None,
    grad_comm_seconds: Callable[[], float] | None = None,
    state: TrainState | None = None,
) -> TrainHistory:
    """Run `cfg.epochs` epochs of `step` over `loader`, evaluating after each.

    `grad_comm_seconds`, if given, returns the seconds gradient all-reduces have been in flight
    so far (the ddp strategy's timed comm hook provides one). `state` (this rank's model part,
    optimizer, scheduler, scaler) lets the training task's checkpointer save and resume it; a
    strategy that gives none trains without checkpoints.
    """
    history = TrainHistory(strategy=strategy, world_size=ctx.world_size)
    ckpt = _checkpointers[-1] if _checkpointers and state is not None else None
    if _checkpointers and state is None and ctx.is_main:
        log.warning("strategy %r hands fit no TrainState: this run keeps no checkpoints", strategy)
    position = Position()
    if ckpt is not None:
        found = ckpt.restore(state, ctx, strategy)  # type: ignore[arg-type]
        if found is not None:
            position, resumed = found
            history.resumed_from_step, history.resumed_from = resumed.step, f"{resumed.path} ({resumed.source})"
            history.epochs = [EpochMetrics(**m) for m in position.history]
    steps_per_epoch = len(loader)
    done = [position.step]  # optimizer steps taken so far, over every attempt

    def after_step(batch: int, losses: Callable[[], list[float]], hits: list, rows: int, wait: float,
                   seconds: float) -> None:
        done[0] += 1
        if ckpt is not None and ckpt.due(done[0], ctx):
            at = Position(step=done[0], epoch=epoch, batch=batch, losses=losses(),
                          hits=[float(v) for v in hits], rows=rows, wait=wait, seconds=seconds,
                          history=[vars(m).copy() for m in history.epochs])
            ckpt.save(state, at, ctx, strategy)  # type: ignore[arg-type]

    with train_progress(cfg.epochs, steps_per_epoch, main=ctx.is_main, world_size=ctx.world_size) as bar:
        comm_before = grad_comm_seconds() if grad_comm_seconds else 0.0
        for epoch in range(position.epoch, cfg.epochs):
            set_epoch(loader, epoch)
            model.train()
            resume_here = position if epoch == position.epoch else None
            # Without a checkpointer no per-step hook runs (one call a step on the hot path).
            loss_sum, correct, count, wait, seconds, first_bad = _train_epoch(
                step, loader, ctx, bar, resume_here, after_step if ckpt is not None else None,
                ckpt.restore_rng if ckpt is not None else None,
            )
            if ckpt is None:
                done[0] += steps_per_epoch - (resume_here.batch if resume_here is not None else 0)
            v_loss, v_correct, v_count = evaluate()
            comm_now = grad_comm_seconds() if grad_comm_seconds else 0.0
            grad_comm, comm_before = comm_now - comm_before, comm_now
            tracked = correct is not None
            m = _epoch_metrics(
                epoch, [loss_sum, correct or 0.0, count, v_loss, v_correct, v_count, wait, grad_comm, seconds], ctx,
                tracked,
            )
            if not math.isfinite(m.train_loss):  # summed over ranks: every rank sees it and stops together
                raise _diverged(epoch, first_bad, steps_per_epoch, cfg, ctx)
            m.lr = optimizer.param_groups[0]["lr"] if optimizer is not None else cfg.lr
            # The whole model as this rank has it, not only the part it trains (state.module):
            # layers held in memory but not trained would count too.
            if state is not None and not history.state_mb:
                history.state_mb = [b / 2**20 for b in ctx.all_gather_object(state_bytes(model, state.optimizer))]  # type: ignore[operator]
                if ctx.is_main:
                    log.info("parameters, gradients and optimizer state held per rank: %s MiB",
                             ", ".join(f"{mb:.2f}" for mb in history.state_mb))
            history.epochs.append(m)
            history.diagnosis = diagnose(m, cfg, ctx.world_size) or history.diagnosis
            if bar is not None:
                bar.end_epoch(m.samples_per_s)
            if ctx.is_main:
                for listener in _listeners:
                    listener(m)
                acc = f"  acc {m.train_accuracy:.4f}" if m.train_accuracy is not None else ""
                log.info(
                    "epoch %d/%d  loss %.4f%s  val_loss %.4f  val_acc %.4f  %.0f samples/s  data-wait %.0f%%",
                    epoch + 1, cfg.epochs, m.train_loss, acc, m.val_loss, m.val_accuracy,
                    m.samples_per_s, 100 * m.data_wait_fraction,
                )
    history.steps, history.steps_run = done[0], done[0] - position.step
    if ckpt is not None:
        history.checkpoints_saved, history.checkpoint_seconds = len(ckpt.saved), ckpt.seconds_saving
    if history.diagnosis and ctx.is_main:
        log.warning("%s", history.diagnosis)
    return history


def _epoch_metrics(epoch: int, local: list[float], ctx: DistContext, tracked: bool = True) -> EpochMetrics:
    """Sum this rank's epoch counters over all ranks into one EpochMetrics (lr left to the caller)."""
    seconds = local[-1]  # this rank's own wall time: the reductions below are not part of the epoch
    comm_start = time.perf_counter()
    loss_sum, correct, count, v_loss, v_correct, v_count, wait_all, grad_comm_all, seconds_all = ctx.all_reduce_sum(
        local
    )
    comm = time.perf_counter() - comm_start
    mem = max(ctx.all_gather_object(peak_memory_mb(ctx.device)))  # type: ignore[type-var]
    wall = seconds + comm
    return EpochMetrics(
        epoch=epoch,
        train_loss=loss_sum / count,
        train_accuracy=correct / count if tracked else None,
        val_loss=v_loss / max(v_count, 1),
        val_accuracy=v_correct / max(v_count, 1),
        seconds=seconds,
        samples_per_s=count / seconds if seconds > 0 else 0.0,
        data_wait_fraction=wait_all / seconds_all if seconds_all > 0 else 0.0,
        compute_fraction=(seconds_all - wait_all) / seconds_all * seconds / wall if seconds_all > 0 else 0.0,
        comm_fraction=comm / wall if wall > 0 else 0.0,
        grad_comm_fraction=grad_comm_all / seconds_all if seconds_all > 0 else 0.0,
        peak_memory_mb=float(mem),
    )
