"""The one module that knows about ranks.

Everything about process groups, RANK/LOCAL_RANK/WORLD_SIZE, samplers and rank-0-only side
effects lives here. (`IgnoreOutputs` for ranks other than 0 is raised by flytekit's Elastic
agent itself: only global rank 0's return value becomes the task's output.) Model code and the
training loop receive a `DistContext` and never look at the environment themselves
(tests/test_architecture.py enforces this). It runs past 300 lines on purpose: split, ranks
would be known in two places.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset

from flyscale.data.streaming import ShufflesItself
from flyscale.plugin import registry

T = TypeVar("T")

log = logging.getLogger(__name__)

_HEADER = 9  # send_tensor's shape header: the number of dimensions, then up to 8 sizes


@dataclass(frozen=True)
class DistContext:
    """Who this process is in the job. `world_size == 1` means a plain single process."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        """True on the one process that logs, writes files and talks to MLflow."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """Sum a few floats over all ranks (identity on one process)."""
        if not self.distributed:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def all_gather_object(self, obj: T) -> list[T]:
        """Every rank's `obj`, in rank order."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def from_main(self, obj: T) -> T:
        """Rank 0's `obj`, on every rank. Every rank must call it, whatever it passes: a decision
        made on rank 0 alone (a search's pruning) reaches the others here."""
        if not self.distributed:
            return obj
        box: list[Any] = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_object(self, obj: T) -> list[T]:
        """Every rank's `obj` in rank order on rank 0 (the others get an empty list)."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out or []

    def send_tensor(self, tensor: torch.Tensor, dst: int) -> None:
        """Send `tensor` (any shape, float32) to rank `dst`, which takes it with `recv_tensor`."""
        # The shape first, in a fixed-size header, so the receiver needs to know nothing in advance.
        if tensor.dim() >= _HEADER:
            raise ValueError(f"send_tensor takes at most {_HEADER - 1} dimensions, got shape {tuple(tensor.shape)}")
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        header[0] = tensor.dim()
        header[1 : 1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        dist.send(header, dst)
        dist.send(tensor.to(self.device, torch.float32).contiguous(), dst)

    def recv_tensor(self, src: int) -> torch.Tensor:
        """The tensor rank `src` sends with `send_tensor`."""
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, src)
        shape = header[1 : 1 + int(header[0])].tolist()
        out = torch.empty(shape, dtype=torch.float32, device=self.device)
        dist.recv(out, src)
        return out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def train_sampler(self, dataset: TensorDataset, *, seed: int) -> Sampler:
        """Shuffled, and sharded for training: every rank gets the same number of samples
        (padding, never a hang)."""
        if self.world_size == 1:
            return torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
        return DistributedSampler(
            dataset, num_replicas=self.world_size, rank=self.rank, shuffle=True, seed=seed, drop_last=False
        )

    def eval_indices(self, n: int) -> range:
        """This rank's disjoint share of an evaluation set: no padding, so summed counts are exact."""
        return range(self.rank, n, self.world_size)


def set_epoch(loader: Any, epoch: int) -> None:
    """Reshuffle `loader` (a DataLoader, TensorBatches or AugmentedBatches) for `epoch`: without
    this every epoch sees one order."""
    own = loader.dataset if isinstance(loader, DataLoader) else loader
    if isinstance(own, ShufflesItself):  # augmented batches, or a DataLoader of the streamed dataset
        own.set_epoch(epoch)
        return
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        sampler.set_epoch(epoch)
    elif isinstance(sampler, torch.utils.data.RandomSampler) and sampler.generator is not None:
        # Same contract for one process: the order depends on (seed, epoch), not on history.
        seed = getattr(sampler, "_flyscale_seed", None)
        if seed is None:
            seed = sampler.generator.initial_seed()
            sampler._flyscale_seed = seed  # type: ignore[attr-defined]  # epoch 0's seed, kept on the sampler
        sampler.generator.manual_seed(seed + epoch)


def sampler_order(sampler: Sampler) -> torch.Tensor:
    """This epoch's indices from `sampler`, as one int64 tensor.

    The two samplers `DistContext.train_sampler` makes are drawn here as they draw themselves
    (the same generator, seeds and calls, torch 2.13's code), so the order is theirs, without a
    Python int per row: iterating one took 0.13 ms of a 47 ms epoch on the digits MLP
    (benchmarks/bench_trainer.py). Any other sampler is iterated.
    """
    if type(sampler) is torch.utils.data.RandomSampler and not sampler.replacement and sampler.generator is not None:
        n = len(sampler.data_source)
        if sampler.num_samples == n:
            order = torch.randperm(n, generator=sampler.generator)
            torch.randperm(
                n, generator=sampler.generator
            )  # RandomSampler draws (and drops) one more: leave the generator as it would
            return order
    if type(sampler) is DistributedSampler and sampler.shuffle:
        g = torch.Generator()
        g.manual_seed(sampler.seed + sampler.epoch)
        order = torch.randperm(len(sampler.dataset), generator=g)  # type: ignore[arg-type]  # map-style: it has a length
        if sampler.drop_last:
            order = order[: sampler.total_size]
        elif sampler.total_size > len(order):  # padded with the order's own first indices, repeated as needed
            order = torch.cat(
                [order, order.repeat(math.ceil(sampler.total_size / len(order)))[: sampler.total_size - len(order)]]
            )
        return order[sampler.rank : sampler.total_size : sampler.num_replicas]
    return torch.tensor(list(sampler), dtype=torch.int64)


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo for everything else."""
    return "nccl" if device.type == "cuda" else "gloo"


def local_world_size(ctx: DistContext) -> int:
    """How many workers of this job run on this node (torch-elastic's LOCAL_WORLD_SIZE; all of
    them where it is unset)."""
    return _env_int("LOCAL_WORLD_SIZE", ctx.world_size)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def context_from_env() -> DistContext:
    """Read the torchrun/torch-elastic environment, without initialising anything."""
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    world = _env_int("WORLD_SIZE", 1)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    return DistContext(rank=rank, local_rank=local_rank, world_size=world, device=device)


@contextlib.contextmanager
def process_group(timeout_s: float = 300.0, threads: int = 0) -> Iterator[DistContext]:
    """Join the job's process group for the duration of the block, then leave it cleanly.

    Under torch-elastic (Flyte's Elastic task, torchrun) the environment names our rank; in a
    plain process we run alone. The timeout turns a lost peer into an error instead of a hang.
    `threads` > 0 is this worker's torch thread count for the block (a scaling study gives each
    worker the same share); 0 keeps what the launcher set in OMP_NUM_THREADS.
    """
    ctx = context_from_env()
    owns_group = ctx.world_size > 1 and not dist.is_initialized()
    before = torch.get_num_threads()
    if owns_group:
        if ctx.device.type == "cuda":
            torch.cuda.set_device(ctx.device)
        dist.init_process_group(
            backend_for(ctx.device), timeout=timedelta(seconds=timeout_s), **_round_store(timeout_s)
        )
        # A forked worker still has its parent's thread count; a spawned one read this at import.
        threads = threads or _env_int("OMP_NUM_THREADS", 0)
    if threads:
        torch.set_num_threads(threads)
    configure_logging(ctx)
    try:
        yield ctx
    except RuntimeError as exc:  # gloo and NCCL report a peer gone quiet as a RuntimeError
        if owns_group and _peer_lost(exc):
            message = _lost_peer_message(ctx, exc, timeout_s)
            # Said now: the launcher reports it only once it has stopped every worker, which for a
            # stopped one means waiting out its SIGTERM grace.
            log.error("%s", message)
            raise LostPeer(message) from exc
        raise
    finally:
        if owns_group:
            dist.destroy_process_group()
        torch.set_num_threads(before)


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """This worker's torch on `threads` threads while the block runs (0: as it is)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _round_store(timeout_s: float) -> dict:
    """The key-value store of this round of workers, when torch-elastic restarted the group on one node.

    torch 2.13's agent hands every round the same store (its MASTER_PORT), so a restarted
    worker group reads the addresses its dead predecessors published there and gloo times out
    connecting to them. A prefix per restart keeps the rounds apart. (On one node every worker
    counts the same restarts; across nodes the counts may differ, so there the default stands.)
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if not restart or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    if os.environ.get("LOCAL_WORLD_SIZE") != os.environ.get("WORLD_SIZE"):
        return {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=timeout_s)
    )
    return {
        "store": dist.PrefixStore(f"flyscale/round-{restart}", store),
        "rank": _env_int("RANK", 0),
        "world_size": _env_int("WORLD_SIZE", 1),
    }


class LostPeer(RuntimeError):
    """A worker stopped answering (killed, stopped, its node gone): a retry may succeed. (The
    training task raises it to Flyte as retryable; this module stays free of flytekit, which
    every worker would otherwise import.)"""


def _peer_lost(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, dist.DistError) or any(
        s in text
        for s in (
            "Timed out waiting",
            "Connection closed by peer",
            "Connection reset by peer",
            "pair closure",
            "Watchdog caught collective operation timeout",
        )
    )


def _lost_peer_message(ctx: DistContext, exc: BaseException, timeout_s: float, grace_s: float = 3.0) -> str:
    """Which ranks are gone, asked of the job's key-value store (which lives in torch-elastic's
    agent, not in any worker): every rank that notices checks in, waits `grace_s` for the other
    survivors (they time out at about the same moment), and names the ranks that never did."""
    lost = "unknown"
    try:
        store = dist.distributed_c10d._get_default_store()  # no public accessor in torch 2.13
        prefix = f"flyscale/alive/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        store.set(f"{prefix}/{ctx.rank}", "1")
        time.sleep(grace_s)
        missing = [r for r in range(ctx.world_size) if not store.check([f"{prefix}/{r}"])]
        lost = ", ".join(str(r) for r in missing) or "none (every rank answered the store)"
    except Exception as store_exc:  # noqa: BLE001 (the store may be gone with the peer)
        lost = f"unknown (the store did not answer: {store_exc})"
    return (
        f"rank {ctx.rank} lost its peers: no answer within recovery.collective_timeout_s={timeout_s:g}s. "
        f"Lost rank(s): {lost}. A killed, stopped or preempted worker, or a network partition; the task is "
        f"retried and resumes from its last checkpoint. ({exc})"
    )


def configure_logging(ctx: DistContext) -> None:
    """INFO logs from rank 0; other ranks only warn, so a run's log reads as one process."""
    if not logging.getLogger().handlers:
        # A fresh worker process (torch-elastic spawns them): without a handler Python prints
        # warnings only, and the per-epoch lines would never reach the task log. Root stays at
        # WARNING, so only our own loggers (below) speak at INFO.
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    level = logging.INFO if ctx.is_main else logging.WARNING
    for package in ("flyscale", *plugin_packages()):
        logging.getLogger(package).setLevel(level)


def plugin_packages() -> list[str]:
    """Top-level packages that provide plugins: their loggers speak like flyscale's own."""
    return sorted({m.split(".")[0] for r in registry.ALL.values() for m in r.source_modules()})


def rank_zero_outputs(ctx: DistContext, value):
    """The task's outputs on global rank 0; other ranks hand back nothing.

    Under torch-elastic (Flyte's `Elastic` task) the agent keeps only rank 0's return value, so
    other ranks return None. In a classic PyTorchJob every pod is its own Flyte task execution,
    so other ranks tell Flyte their outputs are not the task's by raising `IgnoreOutputs`.
    """
    if ctx.is_main:
        return value
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return None
    from flytekit.core.base_task import IgnoreOutputs

    raise IgnoreOutputs(f"rank {ctx.rank} of {ctx.world_size}: only rank 0 returns outputs")
