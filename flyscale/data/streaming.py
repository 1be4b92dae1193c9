"""Training on data larger than memory: batches streamed from Parquet row groups.

Each epoch the row groups of the split are shuffled (seeded by the seed and the epoch), laid end
to end and cut into one equal run of rows per (rank, DataLoader worker). A worker reads its row
groups one at a time (only the columns trained on), mixes them into a bounded buffer of rows, and
yields shuffled batches from it. Memory holds the buffer and one row group, whatever the data's
size.

Every (rank, worker) holds the same number of rows, so every rank yields exactly the same number
of batches per epoch and no rank waits in a collective for one that ran out. Fewer than a batch
of rows per worker (and the remainder of the equal cut) is left out of an epoch, a different few
each epoch. Ranks come only from the `DistContext` the strategy hands in.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import IterableDataset, get_worker_info

from flyscale.data.fields import Reader

if TYPE_CHECKING:  # only types here: importing shards would pull in flytekit for every worker
    from flyscale.data.augment import Augment
    from flyscale.data.shards import Unit

BUFFER_ROWS = 16_384  # rows mixed across row groups before a batch is drawn
BUFFER_BYTES = 64 * 2**20  # and at most this much of them (a row of a 3x32x32 image is 3 KB)


def buffer_rows(reader: Reader) -> int:
    """Rows the shuffle buffer holds: BUFFER_ROWS, fewer where examples are large."""
    return max(1024, min(BUFFER_ROWS, BUFFER_BYTES // reader.example_bytes()))


@dataclass(frozen=True)
class Stream:
    """Where a split's shards are and what to read from them, and what is done to each training
    batch as it is drawn (augmentation), if anything."""

    train: list[Unit]
    val: list[Unit]
    reader: Reader
    buffer_rows: int = BUFFER_ROWS
    augment: Augment | None = None


def read_unit(unit: Unit, reader: Reader) -> tuple[np.ndarray, np.ndarray]:
    """One row group: (inputs, labels int64), as `reader` reads them."""
    x, y = read_stored_unit(unit, reader)
    return reader.to_model(x), y


def read_stored_unit(unit: Unit, reader: Reader) -> tuple[np.ndarray, np.ndarray]:
    """One row group, decoded but as stored (uint8 images stay uint8)."""
    return reader.read_stored(pq.ParquetFile(unit.file).read_row_group(unit.row_group, columns=reader.columns))


class ShufflesItself:
    """What reshuffles itself for an epoch, where there is no sampler to reseed: the streamed
    dataset, and the training batches that augment as they are drawn. `set_epoch` (flyscale.train.distributed)
    tells these apart by this type."""

    def set_epoch(self, epoch: int) -> None:
        raise NotImplementedError


class StreamingShards(IterableDataset, ShufflesItself):
    """Shuffled batches of `batch_size` rows for this rank, from row groups of Parquet shards."""

    def __init__(
        self,
        units: list[Unit],
        reader: Reader,
        batch_size: int,
        *,
        rank: int,
        world: int,
        workers: int,
        seed: int,
        buffer_rows: int = BUFFER_ROWS,
        augment: Augment | None = None,
    ):
        if not units:
            raise ValueError("the training split has no rows to stream")
        self.units, self.reader, self.augment = list(units), reader, augment
        self.batch_size, self.rank, self.world = batch_size, rank, world
        self.workers, self.seed, self.buffer_rows = max(1, workers), seed, buffer_rows
        self._epoch, self._iterations = 0, 0
        rows, parts = sum(u.rows for u in self.units), self.world * self.workers
        if rows // parts < batch_size:  # an epoch of no steps: say so, rather than train on nothing
            raise ValueError(
                f"the training split's {rows} rows, streamed, give each of {self.world} rank(s) x {self.workers} "
                f"loader worker(s) {rows // parts} rows, less than train.batch_size ({batch_size}): lower "
                f"train.batch_size or train.num_workers, or set data.streaming: false for data this small"
            )

    def set_epoch(self, epoch: int) -> None:
        """The shuffle of `epoch`. Persistent DataLoader workers keep their own copy of this object
        and do not see the call; they count their passes instead (see __iter__)."""
        self._epoch, self._iterations = epoch, 0

    def plan(self, epoch: int) -> dict[tuple[int, int], tuple[list[tuple[Unit, int, int]], int]]:
        """{(rank, worker): (its (row group, first row, end row) pieces, its number of batches)}.

        The row groups, shuffled for the epoch, are laid end to end and cut into one equal run of
        rows per (rank, worker): every part holds the same rows, so every rank the same batches,
        however few or uneven the row groups. The same on every process.
        """
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.units))
        parts = self.world * self.workers
        size = sum(u.rows for u in self.units) // parts
        plan: dict[tuple[int, int], tuple[list[tuple[Unit, int, int]], int]] = {}
        pieces: list[tuple[Unit, int, int]] = []
        part, room = 0, size
        for unit in (self.units[i] for i in order):
            start = 0
            while start < unit.rows and part < parts:
                take = min(room, unit.rows - start)
                pieces.append((unit, start, start + take))
                start, room = start + take, room - take
                if room == 0:
                    plan[(part % self.world, part // self.world)] = (pieces, size // self.batch_size)
                    pieces, part, room = [], part + 1, size
        for p in range(part, parts):  # only when there are fewer rows than parts
            plan[(p % self.world, p // self.world)] = ([], 0)
        return plan

    def __len__(self) -> int:
        """Batches this rank yields per epoch: the same on every rank."""
        plan = self.plan(self._epoch)
        return sum(plan[(self.rank, w)][1] for w in range(self.workers))

    def __iter__(self):
        info = get_worker_info()
        worker = info.id if info is not None else 0
        epoch = self._epoch + self._iterations
        self._iterations += 1
        pieces, quota = self.plan(epoch)[(self.rank, worker)]
        rng = np.random.default_rng([self.seed, epoch, self.rank, worker])
        key = (epoch, self.rank, worker)
        buf_x = self.reader.empty()  # as stored (uint8 images: a quarter of float32's memory)
        buf_y = np.empty(0, dtype=self.reader.label_dtype)  # class ids, or float32 targets
        emitted = 0
        for unit, first, end in pieces:
            if emitted >= quota:
                return
            x, y = read_stored_unit(unit, self.reader)
            buf_x, buf_y = np.concatenate([buf_x, x[first:end]]), np.concatenate([buf_y, y[first:end]])
            ready = (len(buf_y) - self.buffer_rows) // self.batch_size
            if ready > 0:
                batches, buf_x, buf_y = self._draw(buf_x, buf_y, min(ready, quota - emitted), rng)
                yield from self._batches(batches, key, emitted)
                emitted += len(batches)
        batches, _, _ = self._draw(buf_x, buf_y, quota - emitted, rng)
        yield from self._batches(batches, key, emitted)

    def _batches(
        self, batches: list, key: tuple[int, int, int], first: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Stored batches as models take them, each augmented (seeded by epoch, rank, worker, batch)."""
        for k, (x, y) in enumerate(batches, start=first):
            x = self.reader.to_model(x)
            if self.augment is not None:
                x = self.augment(x, (*key, k))
            yield torch.from_numpy(x), torch.from_numpy(y)

    def _draw(self, x: np.ndarray, y: np.ndarray, n: int, rng: np.random.Generator):
        """`n` batches of random rows of the buffer, and the rows left in it."""
        perm = rng.permutation(len(y))
        n = min(n, len(y) // self.batch_size)
        take, keep = perm[: n * self.batch_size], perm[n * self.batch_size :]
        batches = [
            (x[take[i : i + self.batch_size]], y[take[i : i + self.batch_size]])
            for i in range(0, n * self.batch_size, self.batch_size)
        ]
        return batches, x[keep], y[keep]


def unit_batches(
    units: list[Unit], reader: Reader, batch_size: int = 4096
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The rows of `units`, in order, as (inputs, labels) CPU tensors of up to `batch_size` rows."""
    for unit in units:
        x, y = read_unit(unit, reader)
        for start in range(0, len(y), batch_size):
            yield torch.from_numpy(x[start : start + batch_size]), torch.from_numpy(y[start : start + batch_size])
