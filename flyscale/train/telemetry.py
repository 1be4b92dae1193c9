"""What an epoch measured, summed over every rank, and what it says about the run: throughput,
where the time went (waiting for data, computing, communicating), memory, and a diagnosis
with the knob to turn when the input pipeline or the gradients' all-reduce sets the pace."""

from __future__ import annotations

import dataclasses
import logging
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from flyscale.config import TrainConfig
from flyscale.train.distributed import DistContext

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
    samples: int = 0  # training rows of the epoch, over every rank

    def per_epoch(self) -> dict[str, float | None]:
        """The metrics MLflow charts per epoch, by their MLflow names (None: not measured)."""
        return {
            "train_loss": self.train_loss,
            "train_accuracy": self.train_accuracy,
            "val_loss": self.val_loss,
            "val_accuracy": self.val_accuracy,
            "epoch_seconds": self.seconds,
            "samples_per_s": self.samples_per_s,
            "lr": self.lr,
            "data_wait_fraction": self.data_wait_fraction,
            "compute_fraction": self.compute_fraction,
            "comm_fraction": self.comm_fraction,
            "grad_comm_fraction": self.grad_comm_fraction,
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
    resharded: str = ""  # how a checkpoint of another number of workers was resumed ("" = it was not)
    # Early stopping: the epoch (from 1) whose weights are handed on, and what it did, in words
    # (0 and "" when it is off: the last epoch's weights).
    kept_epoch: int = 0
    stopping: str = ""
    started_from: str = ""  # the weights training started from (model.init_from), resolved; "" = fresh ones
    checkpoints_saved: int = 0  # in this attempt
    checkpoint_seconds: float = 0.0  # rank 0's wall time spent writing them
    # Per rank, the MiB of parameters, gradients and optimizer state it holds to train (after the
    # first epoch of this attempt, when all three exist); empty where the strategy gave no TrainState.
    state_mb: list[float] = field(default_factory=list)
    workers: str = ""  # how many workers trained, and how that count was chosen, in one line
    parameters: int = 0  # the model's, each counted once
    trained_parameters: int = 0  # of those, the ones training updates (LoRA: the adapters')


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of `module`'s parameters, their gradients and `optimizer`'s state held in memory
    (meta tensors hold none; a storage shared by several tensors counts once)."""
    tensors = [t for p in module.parameters() for t in (p, p.grad) if t is not None]
    if optimizer is not None:
        tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    # A sharded tensor (DTensor) counts what this rank holds of it: its local shard.
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local if not t.is_meta}
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
    return (
        f"a larger batch per worker (train.batch_size, now {cfg.batch_size}), fewer workers "
        f"(FLYSCALE_NPROC_PER_NODE), or larger gradient buckets (train.options.bucket_cap_mb)"
    )


class InFlight:
    """The seconds at least one collective of a kind was in flight: call it for the total so far.

    Collectives overlap one another (DDP launches many small buckets before the first finishes;
    FSDP prefetches the next unit's all-gather while this one computes), so the clock counts the
    union of their launch-to-completion intervals, not their sum: it never exceeds the wall time
    it was measured over. `what` names them and `knobs(cfg)` says what to turn, for the diagnosis.
    """

    def __init__(self, what: str, knobs: Callable[[TrainConfig], str]):
        self.what, self.knobs = what, knobs
        self._lock = threading.Lock()
        self._in_flight, self._since, self._total = 0, 0.0, 0.0

    def launched(self) -> Callable[[], None]:
        """Record a collective launched now; call what this returns when it has finished (on any thread)."""
        with self._lock:
            if self._in_flight == 0:
                self._since = time.perf_counter()
            self._in_flight += 1

        def finished() -> None:
            with self._lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._total += time.perf_counter() - self._since

        return finished

    def __call__(self) -> float:
        with self._lock:
            return self._total


def steady(values: list[float]) -> tuple[float, float, float]:
    """(median, lower quartile, upper quartile) of a per-epoch rate over the epochs after the first,
    which pays for warm-up (or the first alone). The training diagnosis and the scaling study's
    worker advice both rest on it, so that one run never says two things."""
    kept = values[1:] or values
    if not kept:
        return 0.0, 0.0, 0.0
    low, median, high = np.percentile(kept, [25, 50, 75])
    return float(median), float(low), float(high)


def diagnose_epochs(
    epochs: list[EpochMetrics],
    cfg: TrainConfig,
    world_size: int = 1,
    comm: InFlight | None = None,
    workers_timed: bool = False,
) -> str:
    """The diagnosis of a whole training: `diagnose` on the steady epochs' medians, with their
    spread where there are several. `workers_timed`: the worker count was timed as the faster
    (auto), so communication, however large its share, is not called the bottleneck."""
    if not epochs:
        return ""
    rates = {
        name: steady([getattr(m, name) for m in epochs])
        for name in ("data_wait_fraction", "grad_comm_fraction", "samples_per_s")
    }
    typical = dataclasses.replace(
        epochs[-1],
        data_wait_fraction=rates["data_wait_fraction"][0],
        grad_comm_fraction=rates["grad_comm_fraction"][0],
        samples_per_s=rates["samples_per_s"][0],
    )
    counted = len(epochs[1:] or epochs)
    spread = {
        name: f" (median of {counted} epochs, quartiles {r[1]:.0%}-{r[2]:.0%})" if counted > 2 else ""
        for name, r in rates.items()
    }
    return diagnose(typical, cfg, 1 if workers_timed else world_size, comm, spread)


def diagnose(
    m: EpochMetrics,
    cfg: TrainConfig,
    world_size: int = 1,
    comm: InFlight | None = None,
    spread: dict[str, str] | None = None,
) -> str:
    """Name the knob to turn when the input pipeline or communication (`comm`'s collectives;
    the gradients' all-reduce when None), not the model, sets the pace; "" when neither does.
    `spread`: what each fraction rests on, said after it."""
    found = []
    said = spread or {}
    if m.data_wait_fraction >= DATA_WAIT_WARNING:
        hint = (
            f"raise train.num_workers (now {cfg.num_workers})"
            if cfg.num_workers == 0
            else "raise train.num_workers or train.prefetch_factor, or set train.persistent_workers"
        )
        found.append(
            f"input-bound: {m.data_wait_fraction:.0%} of each epoch waits for data"
            f"{said.get('data_wait_fraction', '')}, so the accelerator idles; {hint}"
        )
    if world_size > 1 and m.grad_comm_fraction >= COMM_WARNING:
        found.append(
            f"communication-bound: {comm.what if comm else 'gradient all-reduces'} are in flight "
            f"{m.grad_comm_fraction:.0%} of each step{said.get('grad_comm_fraction', '')} on {world_size} workers "
            f"({m.samples_per_s:,.0f} samples/s), so "
            f"at this model size and batch one process with the same cores may train faster; "
            f"FLYSCALE_NPROC_PER_NODE=auto times both and trains on the faster. Knobs: {comm.knobs(cfg) if comm else data_parallel_knobs(cfg)}"
        )
    return "; ".join(found)


def epoch_metrics(epoch: int, local: list[float], ctx: DistContext, tracked: bool = True) -> EpochMetrics:
    """Sum this rank's epoch counters over all ranks into one EpochMetrics (lr left to the caller)."""
    seconds = local[-1]  # this rank's own wall time: the reductions below are not part of the epoch
    comm_start = time.perf_counter()
    loss_sum, correct, count, v_loss, v_correct, v_count, wait_all, grad_comm_all, seconds_all = ctx.all_reduce_sum(
        local
    )
    comm = time.perf_counter() - comm_start
    mem = max(ctx.all_gather_object(peak_memory_mb(ctx.device)))
    wall = seconds + comm
    return EpochMetrics(
        epoch=epoch,
        train_loss=loss_sum / count,
        train_accuracy=correct / count if tracked else None,
        val_loss=v_loss / max(v_count, 1),
        val_accuracy=v_correct / max(v_count, 1),
        seconds=seconds,
        samples_per_s=count / seconds if seconds > 0 else 0.0,
        samples=int(count),
        data_wait_fraction=wait_all / seconds_all if seconds_all > 0 else 0.0,
        compute_fraction=(seconds_all - wait_all) / seconds_all * seconds / wall if seconds_all > 0 else 0.0,
        comm_fraction=comm / wall if wall > 0 else 0.0,
        grad_comm_fraction=grad_comm_all / seconds_all if seconds_all > 0 else 0.0,
        peak_memory_mb=float(mem),
    )
