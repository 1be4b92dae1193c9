"""The data a strategy trains on, and its batches: in memory by slicing, from a DataLoader when
workers load it, or streamed from Parquet row groups for data larger than memory."""

from __future__ import annotations

import logging
import math
import multiprocessing
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler, TensorDataset

from flyscale.config import TrainConfig
from flyscale.data import fields, shards
from flyscale.data.augment import Augment
from flyscale.data.shards import Shards
from flyscale.data.streaming import ShufflesItself, Stream, StreamingShards, buffer_rows, unit_batches
from flyscale.data.tensors import to_tensors
from flyscale.plugin.records import DatasetInfo
from flyscale.train.distributed import DistContext, sampler_order, set_epoch
from flyscale.train.evaluator import EvalFn, evaluate_split, evaluate_units
from flyscale.train.objective import default as default_objective

log = logging.getLogger(__name__)


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
    augment: Augment | None = None  # typed examples in memory: each training batch as it is drawn
    # What the strategies' steps optimise and validation scores (an ObjectivePlugin); classification when None.
    objective: Any = None

    def __post_init__(self):
        if self.objective is None:
            self.objective = default_objective()

    def train_loader(
        self, cfg: TrainConfig, ctx: DistContext, *, shard: bool = True, drop_last: bool = False
    ) -> Batches:
        """Batches of `cfg.batch_size`: this rank's share (`shard`), or the same batches on every rank.

        In memory and without worker processes, batches are sliced from the tensors; the
        DataLoader serves streamed data and `train.num_workers > 0`.
        """
        world, rank = (ctx.world_size, ctx.rank) if shard else (1, 0)
        if self.stream is not None:
            streamed = StreamingShards(
                self.stream.train,
                self.stream.reader,
                cfg.batch_size,
                rank=rank,
                world=world,
                workers=cfg.num_workers,
                seed=cfg.seed,
                buffer_rows=self.stream.buffer_rows,
                augment=self.stream.augment,
            )
            return DataLoader(
                streamed,
                batch_size=None,
                num_workers=cfg.num_workers,
                pin_memory=cfg.pin_memory and ctx.device.type == "cuda",
                persistent_workers=cfg.persistent_workers and cfg.num_workers > 0,
                prefetch_factor=cfg.prefetch_factor if cfg.num_workers > 0 else None,
                multiprocessing_context=worker_context(cfg.num_workers),
                worker_init_fn=ignore_interrupts,
            )
        dataset = TensorDataset(self.x_train, self.y_train)
        if shard:
            sampler = ctx.train_sampler(dataset, seed=cfg.seed)
        else:  # every rank the same rows in the same order; set_epoch reseeds it identically everywhere
            sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(cfg.seed))
        batches: TensorBatches | DataLoader
        if cfg.num_workers == 0:
            batches = TensorBatches(self.x_train, self.y_train, sampler, cfg.batch_size, drop_last)
        else:
            batches = make_loader(dataset, sampler, cfg, ctx, drop_last=drop_last)
        return batches if self.augment is None else AugmentedBatches(batches, self.augment, rank)

    def evaluator(self, model: nn.Module, ctx: DistContext) -> EvalFn:
        """Loss and accuracy over this rank's disjoint share of the validation split."""
        if self.stream is None:
            return evaluate_split(model, self.x_val, self.y_val, ctx, objective=self.objective)
        s, objective = self.stream, self.objective
        return lambda: evaluate_units(model, s.val, s.reader, ctx.rank, ctx.world_size, ctx.device, objective)

    def val_batches(self, batch_size: int = 1024) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every validation row, in order, in batches (CPU tensors): the same on every rank."""
        if self.stream is None:
            for start in range(0, len(self.y_val), batch_size):
                yield self.x_val[start : start + batch_size], self.y_val[start : start + batch_size]
            return
        yield from unit_batches(self.stream.val, self.stream.reader, batch_size)

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

    GATHER_BYTES = 64 * 2**20

    def __init__(self, x: torch.Tensor, y: torch.Tensor, sampler: Sampler, batch_size: int, drop_last: bool = False):
        self.x, self.y, self.sampler, self.batch_size, self.drop_last = x, y, sampler, batch_size, drop_last

    def __len__(self) -> int:
        n = len(self.sampler)  # type: ignore[arg-type]  # ours (Random, Distributed) have a length
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


class AugmentedBatches(ShufflesItself):
    """In-memory batches, each augmented as it is drawn, seeded by (epoch, rank, 0, batch): the
    same whatever the number of DataLoader workers (which gather the rows; the augmentation runs
    here). `set_epoch` reshuffles the batches underneath and moves the seeds on."""

    def __init__(self, batches: TensorBatches | DataLoader, augment: Augment, rank: int):
        self.batches, self.augment, self.rank = batches, augment, rank
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        set_epoch(self.batches, epoch)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for b, (x, y) in enumerate(self.batches):
            yield torch.from_numpy(self.augment(x.numpy().copy(), (self.epoch, self.rank, 0, b))), y


# What a strategy iterates: batches sliced from tensors in memory, or a DataLoader.
Batches = DataLoader | TensorBatches | AugmentedBatches


def make_loader(
    dataset: Dataset, sampler: Sampler | None, cfg: TrainConfig, ctx: DistContext, drop_last: bool = False
) -> DataLoader:
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
        worker_init_fn=ignore_interrupts,
    )


def ignore_interrupts(_worker_id: int) -> None:
    """In a DataLoader worker: ignore the terminal's Ctrl-C, which reaches every process of the
    run. The rank it serves stops at a step its peers agree on (flyscale/train/interrupt.py) and
    needs its batches until then."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


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


def train_data(train: pd.DataFrame, val: pd.DataFrame, info: DatasetInfo) -> TrainData:
    """The training and validation splits as the tensors strategies train on."""
    return TrainData(*to_tensors(train, info), *to_tensors(val, info))


HEAD_ROWS = 4096  # of a streamed split, held in memory for checks such as the preflight


def train_data_from(
    train: Shards, val: Shards, info: DatasetInfo, augment: Augment | None = None, objective: Any = None
) -> TrainData:
    """The splits strategies train on: read whole when they fit, streamed when they do not;
    `augment` transforms each training batch of typed examples as it is drawn; `objective` is
    what the steps optimise and validation scores (classification when None)."""
    reader = fields.reader(info)
    train_dir, val_dir = train.dir.download(), val.dir.download()
    if not train.streamed:
        log.info("training reads its %d rows into memory", train.rows)
        return TrainData(
            *_tensors(shards.read_table(train_dir, reader.columns), reader),
            *_tensors(shards.read_table(val_dir, reader.columns), reader),
            augment=augment,
            objective=objective,
        )
    stream = Stream(shards.units(train_dir), shards.units(val_dir), reader, buffer_rows(reader), augment)
    log.info("training streams its %d rows from %d row groups", train.rows, len(stream.train))
    heads = [_tensors(shards.head_table(d, HEAD_ROWS, reader.columns), reader) for d in (train_dir, val_dir)]
    return TrainData(*heads[0], *heads[1], stream=stream, objective=objective)


def _tensors(table, reader: fields.Reader) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = reader.read(table)
    return torch.from_numpy(x), torch.from_numpy(y)
