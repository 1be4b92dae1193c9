"""Preparing typed examples (images, text, ...) shard by shard, then combining the shards.

`prepare_shard` is one Flyte map-task instance's work: it validates one shard's examples field
by field (flyscale/data/example_checks.py), quarantines what fails with its origin and reason,
drops examples repeated within the shard (a hash match confirmed by comparing the values),
assigns each kept example to a split by a seeded hash of its origin (so the split does not depend
on how many pods ran, or in what order), and writes a `ShardPart`: the three splits, the
quarantine, and each kept example's content hash. Memory holds a batch.

`combine` is the small step after them: in shard order, it finds examples that repeat one kept by
an earlier shard (hash, then compare), quarantines those, and assembles the final splits from the
parts' files (a file without a repeat is linked or copied as it is, one with a repeat rewritten
without it); it adds up the counts and profiles and applies the quarantine ceiling and drift. The
result is the same whether the shards ran one at a time or many at once.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from flytekit.types.directory import FlyteDirectory

from flyscale.config import DataConfig
from flyscale.data import example_checks, field_profile, fields, shards, table_examples, validation
from flyscale.data.example_checks import Checked
from flyscale.data.prepared import DUPLICATE, SeenRows, split_of
from flyscale.data.reference import Profile
from flyscale.data.shards import ShardWriter
from flyscale.flyte.outputs import output_dir
from flyscale.flyte.provenance import TaskRun
from flyscale.plugin.records import SOURCE_FILE, SOURCE_KEY, SOURCE_ROW, DatasetInfo

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
ORIGIN = ("source_file", "source_row", "source_key")  # how the splits and the quarantine name an example's origin
_PART_BITS, _SPLIT_BITS = np.uint64(40), np.uint64(38)  # a location: part << 40 | split << 38 | position
_POSITION = (np.uint64(1) << _SPLIT_BITS) - np.uint64(1)


@dataclass
class ShardPart:
    """What preparing one shard found: its splits, quarantine and kept examples' hashes (in
    `dir`), the counts and the profile of what it kept."""

    index: int  # the shard's position among the dataset's shards: what orders the combine
    shard: str
    dir: FlyteDirectory  # train/ val/ test/ quarantine/ and seen.parquet (hash, split, position)
    rows: int
    kept: list[int]  # rows per split
    quarantined: int
    checks: dict[str, int] = field(default_factory=dict)
    profile: Profile = field(default_factory=lambda: Profile(rows=0))
    run: TaskRun | None = None  # when the shard's task body ran (set by the task)


def _origin(table: pa.Table, offset: int, default: str) -> pd.DataFrame:
    """Where each example came from: the dataset's origin columns, or `default` and its position."""
    n = table.num_rows

    def column(name: str, fallback: np.ndarray) -> np.ndarray:
        if name not in table.column_names:
            return fallback
        return table.column(name).to_numpy(zero_copy_only=False)

    rows = np.arange(offset, offset + n)
    return pd.DataFrame(
        {
            "source_file": column(SOURCE_FILE, np.full(n, default, dtype=object)).astype(str),
            "source_row": column(SOURCE_ROW, rows).astype("int64"),
            "source_key": pd.Series(column(SOURCE_KEY, rows.astype(str)), dtype="string").fillna("").astype(str),
        }
    )


def quarantine_schema(info: DatasetInfo) -> pa.Schema:
    """One schema for every quarantine file, whatever the failure: the origin, the reason, and
    each field as it came: bytes for an encoded image or a document (exactly as given), numbers
    as float64 (a scalar) or a list of float64 (any length: a wrong shape is kept whole). A
    duplicate found across shards has its fields null: its values are its kept twin's."""
    columns = [(name, pa.int64() if name == "source_row" else pa.string()) for name in ORIGIN]
    columns.append(("reason", pa.string()))
    for f in info.fields:
        kind = pa.binary() if f.dtype == "string" or f.encoding != "raw" else pa.float64()
        columns.append((f.name, pa.list_(kind) if f.shape and kind == pa.float64() else kind))
    return pa.schema(columns)


def _as_came(
    table: pa.Table, origin: pd.DataFrame, rows: np.ndarray, reasons: list[str], info: DatasetInfo
) -> pa.Table:
    """The failing examples as they came, in the quarantine's schema, with origin and reason."""
    schema = quarantine_schema(info)
    picked = origin[rows].reset_index(drop=True)
    columns = {name: pa.array(picked[name]) for name in ORIGIN}
    columns["reason"] = pa.array(reasons, pa.string())
    for f in info.fields:
        column = table.column(f.name).combine_chunks().filter(pa.array(rows))
        target = schema.field(f.name).type
        if pa.types.is_list(target) and pa.types.is_fixed_size_list(column.type):
            column = column.cast(pa.list_(column.type.value_type))
        columns[f.name] = column.cast(target)
    return pa.table(columns, schema=schema)


class _Writers:
    """A shard's three split writers, each kept example's location, and its profile."""

    def __init__(self, root: Path, cfg: DataConfig, info: DatasetInfo, keep_encoded: bool, edges: dict | None):
        self.cfg, self.info, self.keep_encoded = cfg, info, keep_encoded
        rows = fields.row_group_rows(info)
        self.splits = [
            ShardWriter(s, streamed=True, root=str(root / s), rows_per_file=8 * rows, row_group_rows=rows)
            for s in SPLITS
        ]
        self.profiler = field_profile.Profiler(info, edges)

    def add(self, table: pa.Table, checked: Checked, keep: np.ndarray, origin: pd.DataFrame) -> np.ndarray:
        """Write the examples where `keep`; their locations (split << 38 | position)."""
        origin = origin[keep].reset_index(drop=True)
        values = {k: v[keep] for k, v in checked.values.items()}
        named = origin.rename(columns={"source_file": SOURCE_FILE, "source_row": SOURCE_ROW})
        parts = split_of(named, self.cfg, self.info.root)
        where = np.zeros(len(origin), dtype="uint64")
        for i, writer in enumerate(self.splits):
            mine = parts == i
            where[mine] = (np.uint64(i) << _SPLIT_BITS) | np.arange(
                writer.rows, writer.rows + mine.sum(), dtype="uint64"
            )
            columns = {f.name: self._stored(f, table, values, keep, mine) for f in self.info.fields}
            columns.update({name: pa.array(origin[name][mine]) for name in ORIGIN})
            writer.write(pa.table(columns))
        self.profiler.add(values)
        return where

    def _stored(self, f, table: pa.Table, values: dict, keep: np.ndarray, mine: np.ndarray) -> pa.Array:
        if self.keep_encoded and f.encoding != "raw":  # the bytes as they came, decoded by the loader
            return table.column(f.name).combine_chunks().filter(pa.array(keep)).filter(pa.array(mine))
        return fields.to_arrow(values[f.name][mine], f)

    def close(self) -> list[int]:
        schema = fields.split_schema(self.info, self.keep_encoded)
        return [w.close(schema).rows for w in self.splits]


def prepare_shard(
    batches: Iterable[pa.RecordBatch | pa.Table],
    cfg: DataConfig,
    info: DatasetInfo,
    index: int = 0,
    shard: str = "",
    keep_encoded: bool = False,
    edges: dict[str, list[float]] | None = None,
) -> ShardPart:
    """Validate one shard's examples, quarantine failures and repeats within the shard, and write
    its part of the three splits. `edges`: the reference's bins of a table's columns
    (field_profile.reference_edges), which the shard's profile counts on."""
    where = f"dataset {cfg.dataset!r}" + (f", shard {shard!r}" if shard else "")
    root = output_dir(f"flyscale-shard-{index:05d}-")
    writers = _Writers(root, cfg, info, keep_encoded, edges)
    check = _checks(cfg, info, where)
    quarantine = ShardWriter("quarantine", root=str(root / "quarantine"))
    seen, checks, hashes = SeenRows(), Counter[str](), []
    total = 0
    for batch in batches:
        table = pa.Table.from_batches([batch]) if isinstance(batch, pa.RecordBatch) else batch
        if table.num_rows == 0:  # nothing to check (an empty file, a chunk that held no rows)
            continue
        origin = _origin(table, total, f"{cfg.dataset}/{shard}" if shard else cfg.dataset)
        total += table.num_rows
        checked = check(table)
        digest = example_checks.content_hash(checked.values, info)
        ok = ~checked.bad
        earlier, first_at = seen.lookup(digest)
        written = ok & earlier & _same_as_written(writers, checked.values, first_at, earlier & ok, info)
        within = _twins_within(digest, checked.values, ok & ~earlier, info)
        repeats = _duplicate_reasons(writers, origin, within, written, first_at)
        checked.fail(written | (within >= 0), repeats.__getitem__)
        bad, reasons = checked.bad, checked.reason_texts()
        checks.update(name for r, b in zip(reasons, bad, strict=True) if b for name in validation.check_names(r))
        if bad.any():
            quarantine.write(_as_came(table, origin, bad, [r for r, b in zip(reasons, bad, strict=True) if b], info))
        if (~bad).any():
            locations = writers.add(table, checked, ~bad, origin)
            seen.add(digest[~bad], locations)
            hashes.append(pd.DataFrame({"hash": digest[~bad], "location": locations}))
    kept = writers.close()
    quarantine.close(quarantine_schema(info))
    seen_rows = pd.concat(hashes) if hashes else pd.DataFrame({"hash": [], "location": []}, dtype="uint64")
    pq.write_table(pa.Table.from_pandas(seen_rows, preserve_index=False), root / "seen.parquet")
    log.info("shard %r: %d examples, %d kept, %d quarantined", shard, total, sum(kept), quarantine.rows)
    return ShardPart(
        index, shard, FlyteDirectory(str(root)), total, kept, quarantine.rows, dict(checks), writers.profiler.profile()
    )


def _checks(cfg: DataConfig, info: DatasetInfo, where: str) -> Callable[[pa.Table], Checked]:
    """How a batch is checked: a table's rows by its pandera row schema, typed examples field by field."""
    if table_examples.is_table(info):
        schema = validation.row_schema(cfg, table_examples.as_table(info))
        return lambda table: table_examples.check(table, info, schema, where)
    return lambda table: example_checks.check_batch(table, info, where)


def _same_as_written(
    writers: _Writers, values: dict[str, np.ndarray], first_at: np.ndarray, candidates: np.ndarray, info: DatasetInfo
) -> np.ndarray:
    """Candidates whose values equal the kept example their hash matched (read back from the splits)."""
    out = np.zeros(len(candidates), dtype=bool)
    rows = np.flatnonzero(candidates)
    if len(rows) == 0:
        return out
    for w in writers.splits:
        w.close()  # so that what was written can be read back; later rows go to a new file
    units = [shards.units(str(w.root)) if w.rows else [] for w in writers.splits]
    theirs = _read_back(units, first_at[rows], info)
    out[rows] = example_checks.same_content({k: v[rows] for k, v in values.items()}, theirs, info)
    return out


def _read_back(units: list[list[shards.Unit]], locations: np.ndarray, info: DatasetInfo) -> dict[str, np.ndarray]:
    """The values of the kept examples at `locations` (split << 38 | position), in that order."""
    split = (locations >> _SPLIT_BITS).astype("int64") & 3
    position = (locations & _POSITION).astype("int64")
    out: dict[str, np.ndarray] = {}
    for s in np.unique(split):
        at = np.flatnonzero(split == s)
        table = shards.take_table(units[s], position[at], [f.name for f in info.fields])
        got = fields.stored_values(table, info)
        for name, v in got.items():
            if name not in out:
                out[name] = np.empty((len(locations), *v.shape[1:]), dtype=v.dtype)
            out[name][at] = v
    return out


def _twins_within(
    digest: np.ndarray, values: dict[str, np.ndarray], candidates: np.ndarray, info: DatasetInfo
) -> np.ndarray:
    """For each candidate with the same values as an earlier candidate of the batch (hash, then
    compare), that earlier one's position in the batch; -1 for every other example."""
    out = np.full(len(digest), -1, dtype="int64")
    idx = np.flatnonzero(candidates)
    if len(idx) < 2:
        return out
    again = pd.Series(digest[idx]).duplicated(keep="first").to_numpy()
    if not again.any():
        return out
    first = pd.Series(idx).groupby(digest[idx]).transform("first").to_numpy()
    rows, firsts = idx[again], first[again]
    same = example_checks.same_content(
        {k: v[rows] for k, v in values.items()}, {k: v[firsts] for k, v in values.items()}, info
    )
    out[rows[same]] = firsts[same]
    return out


def origins_at(units: list[list[shards.Unit]], locations: np.ndarray) -> pd.DataFrame:
    """The origin columns of the kept examples at `locations` (split << 38 | position), in order."""
    split = (locations >> _SPLIT_BITS).astype("int64") & 3
    position = (locations & _POSITION).astype("int64")
    frames = []
    for s in np.unique(split):
        at = np.flatnonzero(split == s)
        frames.append(shards.take_table(units[s], position[at], list(ORIGIN)).to_pandas().set_axis(at))
    return pd.concat(frames).sort_index()


def _duplicate_reasons(
    writers: _Writers, origin: pd.DataFrame, within: np.ndarray, written: np.ndarray, first_at: np.ndarray
) -> dict[int, str]:
    """{position in the batch: its reason}, for the repeats of an earlier example of the batch
    (`within`) and of one already written (`written`, at `first_at`)."""
    reasons = {int(i): duplicate_reason(origin.iloc[int(within[i])].to_dict()) for i in np.flatnonzero(within >= 0)}
    if written.any():
        units = [shards.units(str(w.root)) if w.rows else [] for w in writers.splits]
        theirs = origins_at(units, first_at[written])
        reasons.update(
            zip(np.flatnonzero(written).tolist(), map(duplicate_reason, theirs.to_dict("records")), strict=True)
        )
    return reasons


def duplicate_reason(twin: dict) -> str:
    """A duplicate's reason, naming the example it repeats (`twin`: its origin) by file and row."""
    return f"{DUPLICATE} ({twin['source_file']} row {twin['source_row']})"
