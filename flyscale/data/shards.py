"""Data between preparation and training: each split as a directory of Parquet shards.

Small data is one shard that training reads whole into memory; data larger than memory is many
shards (each of several row groups) that training streams (flyscale/data/streaming.py). Either way
the tasks after preparation see one type, so one workflow serves both.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import pandas as pd
import pyarrow
import pyarrow.parquet as pq
from flytekit.types.directory import FlyteDirectory

from flyscale.flyte import content
from flyscale.flyte.outputs import output_dir

ROW_GROUP_ROWS = 65_536  # the unit of streaming: one row group is read, shuffled and batched at a time


@dataclass
class Shards:
    """One split: a directory of Parquet files holding `rows` rows."""

    dir: FlyteDirectory
    rows: int
    streamed: bool = False  # larger than memory: train from it by streaming, never read it whole
    # The files' content hash (content.directory_sha256), taken as they were written; "" where
    # unknown, and then taken from the files when it is asked for.
    sha256: str = ""

    def content_key(self) -> dict:
        """What a cache key holds of the split: its bytes and counts, not where it was written."""
        local = self.dir.path if os.path.exists(self.dir.path) else self.dir.download()
        return {"sha256": self.sha256 or content.directory_sha256(local), "rows": self.rows, "streamed": self.streamed}


# A split as a task output: later tasks' cache keys hold its content, not where it was written.
ContentShards = Annotated[Shards, content.BY_CONTENT]


def files(path: str) -> list[str]:
    """The shard files of a local directory, in order."""
    return sorted(str(p) for p in Path(path).glob("*.parquet"))


class ShardWriter:
    """Writes rows to numbered Parquet files as they come, so memory holds one batch at a time."""

    def __init__(
        self,
        name: str,
        rows_per_file: int = 8 * ROW_GROUP_ROWS,
        row_group_rows: int = ROW_GROUP_ROWS,
        streamed: bool = False,
        root: str | None = None,
    ):
        self.streamed = streamed
        self.root = Path(root) if root else output_dir(f"flyscale-{name}-")
        self.root.mkdir(parents=True, exist_ok=True)
        self.rows_per_file, self.row_group_rows = rows_per_file, row_group_rows
        self.rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._in_file = 0
        self._count = 0
        self._pending: list[pyarrow.Table] = []
        self._pending_rows = 0

    def write(self, frame: pd.DataFrame | pyarrow.Table) -> None:
        if len(frame) == 0:
            return
        table = frame if isinstance(frame, pyarrow.Table) else pyarrow.Table.from_pandas(frame, preserve_index=False)
        self._pending.append(table)
        self._pending_rows += len(frame)
        self.rows += len(frame)
        while self._pending_rows >= self.row_group_rows:
            self._flush(self.row_group_rows)

    def _flush(self, rows: int) -> None:
        table = pyarrow.concat_tables(self._pending)
        head, rest = table.slice(0, rows), table.slice(rows)
        self._pending, self._pending_rows = ([rest] if rest.num_rows else []), rest.num_rows
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.root / f"part-{self._count:05d}.parquet", head.schema)
            self._count += 1
        self._writer.write_table(head, row_group_size=self.row_group_rows)
        self._in_file += head.num_rows
        if self._in_file >= self.rows_per_file:
            self._close_file()

    def _close_file(self) -> None:
        assert self._writer is not None
        self._writer.close()
        self._writer, self._in_file = None, 0
        # Hashed while it is fresh in memory: the split's content hash on close reads nothing again.
        content.file_sha256(self.root / f"part-{self._count - 1:05d}.parquet")

    def close(self, schema: pyarrow.Schema | None = None) -> Shards:
        """Flush what is left and return the split (an empty split still has one, empty, file)."""
        if self._pending_rows:
            self._flush(self._pending_rows)
        if self._writer is not None:
            self._close_file()  # rows written after this go to a new file
        if self._count == 0 and schema is not None:
            pq.write_table(schema.empty_table(), self.root / "part-00000.parquet")
        return Shards(
            dir=FlyteDirectory(str(self.root)),
            rows=self.rows,
            streamed=self.streamed,
            sha256=content.directory_sha256(self.root),
        )


def write(frame: pd.DataFrame, name: str) -> Shards:
    """A frame as a split of shards (one file when it is small)."""
    writer = ShardWriter(name, rows_per_file=max(len(frame), 1))
    writer.write(frame)
    return writer.close(pyarrow.Schema.from_pandas(frame, preserve_index=False))


def head(path: str, rows: int, columns: list[str] | None = None) -> pd.DataFrame:
    """The first `rows` rows of a split (a row group at a time: the rest is never read)."""
    if not units(path):
        return pd.DataFrame(columns=columns)
    return head_table(path, rows, columns).to_pandas()


def head_table(path: str, rows: int, columns: list[str] | None = None) -> pyarrow.Table:
    """The first `rows` rows of a split as Arrow (a row group at a time: the rest is never read)."""
    parts, have = [], 0
    for unit in units(path):
        if have >= rows:
            break
        parts.append(pq.ParquetFile(unit.file).read_row_group(unit.row_group, columns=columns))
        have += unit.rows
    return (
        pyarrow.concat_tables(parts, promote_options="default").slice(0, rows) if parts else read_table(path, columns)
    )


def read_table(path: str, columns: list[str] | None = None) -> pyarrow.Table:
    """A whole split as one Arrow table (typed fields stay fixed-size lists: no pandas on the way).
    Files may differ in the columns not asked for (a quarantine's duplicates hold decoded values)."""
    return pyarrow.concat_tables([pq.read_table(f, columns=columns) for f in files(path)], promote_options="default")


def read(path: str, columns: list[str] | None = None) -> pd.DataFrame:
    """A whole split, into memory."""
    tables = [pq.read_table(f, columns=columns) for f in files(path)]
    return pyarrow.concat_tables(tables).to_pandas() if tables else pd.DataFrame(columns=columns)


@dataclass(frozen=True)
class Unit:
    """One row group of one shard: what a loader reads at a time."""

    file: str
    row_group: int
    rows: int


def units(path: str) -> list[Unit]:
    """Every row group of a split, from the files' footers alone."""
    out = []
    for f in files(path):
        meta = pq.ParquetFile(f).metadata
        out += [Unit(f, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
    return out


def take_table(units_: list[Unit], ordinals: np.ndarray, columns: list[str] | None = None) -> pyarrow.Table:
    """The rows at these positions (0 is the split's first row), in the order asked for, as Arrow;
    each row group that holds one is read once."""
    if len(ordinals) == 0:
        return (
            pq.ParquetFile(units_[0].file).schema_arrow.empty_table().select(columns or [])
            if units_
            else pyarrow.table({})
        )
    starts = np.cumsum([0] + [u.rows for u in units_])
    order = np.argsort(ordinals, kind="stable")
    wanted = np.asarray(ordinals, dtype="int64")[order]
    group = np.searchsorted(starts, wanted, side="right") - 1
    parts = []
    for g in np.unique(group):
        unit = units_[g]
        table = pq.ParquetFile(unit.file).read_row_group(unit.row_group, columns=columns)
        parts.append(table.take(pyarrow.array(wanted[group == g] - starts[g])))
    return pyarrow.concat_tables(parts).take(pyarrow.array(np.argsort(order, kind="stable")))


def take(units_: list[Unit], ordinals: np.ndarray) -> pd.DataFrame:
    """The rows at these positions (0 is the split's first row), in the order asked for."""
    if len(ordinals) == 0:
        return pq.ParquetFile(units_[0].file).schema_arrow.empty_table().to_pandas() if units_ else pd.DataFrame()
    return take_table(units_, ordinals).to_pandas()


def size_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in files(path))


def batches_per_epoch(rows: int, batch_size: int) -> int:
    return math.floor(rows / batch_size)


def content_sha256(path: str) -> str:
    """sha256 over the split's files in order (names and bytes): what a test set is recognised by."""
    digest = hashlib.sha256()
    for f in files(path):
        digest.update(Path(f).name.encode() + b"\0")
        with open(f, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
