"""The step after the shards: one set of splits, one quarantine, one report and profile.

Shards are taken in their order. An example whose content hash matches one kept by an earlier
shard is read back beside it and compared; only the same values make it a duplicate, which goes
to the quarantine with its origin and a reason naming its kept twin. The parts' split files are then linked (or copied, across filesystems)
into the final splits as they are; only a file that holds a duplicate is rewritten without it.
Nothing is validated again and only the suspects are read, so the step is small beside the
shards' work.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from flytekit.types.directory import FlyteDirectory

from flyscale.config import DataConfig
from flyscale.data import example_checks, field_profile, fields, shards, table_examples, validation
from flyscale.data.example_prep import (
    _PART_BITS,
    _POSITION,
    _SPLIT_BITS,
    ORIGIN,
    SPLITS,
    ShardPart,
    _read_back,
    duplicate_reason,
    origins_at,
    quarantine_schema,
)
from flyscale.data.prepared import DUPLICATE, Prepared, SeenRows
from flyscale.data.reference import Reference
from flyscale.data.shards import Shards, ShardWriter
from flyscale.data.validation import ValidationReport
from flyscale.errors import DataError, require
from flyscale.flyte import content
from flyscale.flyte.outputs import output_dir
from flyscale.plugin.records import DatasetInfo

log = logging.getLogger(__name__)


class _Part:
    """One shard's part as downloaded: its split files and the hashes of what it kept."""

    def __init__(self, part: ShardPart):
        self.part = part
        self.root = Path(part.dir.download())
        self.units = [shards.units(str(self.root / s)) for s in SPLITS]
        seen = pq.read_table(self.root / "seen.parquet").to_pandas()
        self.hashes = seen["hash"].to_numpy(dtype="uint64")
        self.locations = seen["location"].to_numpy(dtype="uint64")  # split << 38 | position


def combine(parts: list[ShardPart], cfg: DataConfig, info: DatasetInfo, reference: Reference) -> Prepared:
    """The shards' parts as one prepared dataset: duplicates across shards quarantined, the final
    splits assembled, counts and profiles summed, the quarantine ceiling and drift applied."""
    where = f"dataset {cfg.dataset!r}"
    ordered = [_Part(p) for p in sorted(parts, key=lambda p: p.index)]
    total = sum(p.part.rows for p in ordered)
    if total == 0:
        raise DataError(f"{where} holds no {_items(info)} (empty): there is nothing to validate or train on")
    dropped, quarantine, duplicates = _cross_shard_duplicates(ordered, info)
    checks = Counter[str]()
    for p in ordered:
        checks.update(p.part.checks)
    checks.update(validation.check_names(DUPLICATE) * quarantine.rows)
    quarantined_dir = _assemble_quarantine(ordered, quarantine, info)
    profiler = field_profile.merge([p.part.profile for p in ordered])
    if duplicates is not None:  # take back what the repeats had added to their shard's profile
        minus = field_profile.Profiler(info, field_profile.reference_edges(info, reference.profile))
        minus.add(duplicates, sign=-1)
        profiler = field_profile.merge([profiler, minus.profile()])
    quarantined = sum(p.part.quarantined for p in ordered) + quarantine.rows
    valid = sum(sum(p.part.kept) for p in ordered) - quarantine.rows
    report = ValidationReport(
        total_rows=total,
        valid_rows=valid,
        quarantined_rows=quarantined,
        checks=dict(checks),
        reference=reference.source,
    )
    require(
        valid + quarantined == total,
        f"validation lost examples: {total} in, {valid} valid + {quarantined} quarantined out",
    )
    try:
        validation.enforce_ceiling(report, cfg)
    except validation.CeilingExceeded as exc:
        exc.quarantine_dir = quarantined_dir.dir.path
        raise
    train, val, test = (_assemble_split(ordered, s, dropped[s], info) for s in range(len(SPLITS)))
    if reference.profile is not None:
        report.drift = field_profile.psi(profiler, reference.profile)
        validation.enforce_drift(report, cfg)
    log.info(
        "prepared %d examples in %d shards: %d train, %d validation, %d test, %d quarantined",
        *(total, len(ordered), train.rows, val.rows, test.rows, quarantined),
    )
    return Prepared(train, val, test, quarantined_dir, report, profiler, info)


def _cross_shard_duplicates(
    ordered: list[_Part], info: DatasetInfo
) -> tuple[list[dict[int, np.ndarray]], ShardWriter, dict[str, np.ndarray] | None]:
    """In shard order, the kept examples that repeat one kept by an earlier shard: per split,
    {part: positions to drop}; the quarantine rows written for them; their values."""
    seen = SeenRows()
    dropped: list[dict[int, np.ndarray]] = [{} for _ in SPLITS]
    quarantine = ShardWriter("duplicates")
    values: list[dict[str, np.ndarray]] = []
    for k, p in enumerate(ordered):
        found, first = seen.lookup(p.hashes)
        same = np.zeros(len(p.hashes), dtype=bool)
        if found.any():
            mine = _read_back(p.units, p.locations[found], info)
            theirs = _read_earlier(ordered, first[found], info)
            same[np.flatnonzero(found)] = example_checks.same_content(mine, theirs, info)
        if same.any():
            split = (p.locations[same] >> _SPLIT_BITS).astype("int64")
            for s in np.unique(split):
                dropped[s][k] = (p.locations[same][split == s] & _POSITION).astype("int64")
            values.append(_read_back(p.units, p.locations[same], info))
            quarantine.write(_duplicate_rows(p, p.locations[same], first[same], ordered, info))
        seen.add(p.hashes[~same], (np.uint64(k) << _PART_BITS) | p.locations[~same])
    merged = {name: np.concatenate([v[name] for v in values]) for name in values[0]} if values else None
    return dropped, quarantine, merged


def _read_earlier(ordered: list[_Part], locations: np.ndarray, info: DatasetInfo) -> dict[str, np.ndarray]:
    """The values at locations (part << 40 | split << 38 | position) across parts, in that order."""
    part = (locations >> _PART_BITS).astype("int64")
    local = locations & ((np.uint64(1) << _PART_BITS) - np.uint64(1))
    out: dict[str, np.ndarray] = {}
    for k in np.unique(part):
        at = np.flatnonzero(part == k)
        got = _read_back(ordered[k].units, local[at], info)
        for name, v in got.items():
            if name not in out:
                out[name] = np.empty((len(locations), *v.shape[1:]), dtype=v.dtype)
            out[name][at] = v
    return out


def _duplicate_rows(
    p: _Part, locations: np.ndarray, first: np.ndarray, ordered: list[_Part], info: DatasetInfo
) -> pa.Table:
    """Quarantine rows for repeats across shards: origin and a reason naming the kept twin (whose
    values are the repeat's: the fields stay null)."""
    mine = origins_at(p.units, locations)
    part = (first >> _PART_BITS).astype("int64")
    local = first & ((np.uint64(1) << _PART_BITS) - np.uint64(1))
    twins = pd.concat(
        [origins_at(ordered[k].units, local[part == k]).set_axis(np.flatnonzero(part == k)) for k in np.unique(part)]
    )
    twins = twins.sort_index()
    reasons = [duplicate_reason(twin) for twin in twins.to_dict("records")]
    schema = quarantine_schema(info)
    columns = {name: pa.array(mine[name].to_numpy(), schema.field(name).type) for name in ORIGIN}
    columns["reason"] = pa.array(reasons, pa.string())
    columns.update({f.name: pa.nulls(len(reasons), schema.field(f.name).type) for f in info.fields})
    return pa.table(columns, schema=schema)


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed: a copy
        shutil.copyfile(src, dst)


def _assemble_split(ordered: list[_Part], s: int, drop: dict[int, np.ndarray], info: DatasetInfo) -> Shards:
    """Split `s` of every part, in part order: files linked as they are, or rewritten without the
    rows in `drop` ({part: positions})."""
    out = output_dir(f"flyscale-{SPLITS[s]}-")
    rows = 0
    for k, p in enumerate(ordered):
        start = 0
        for n, f in enumerate(shards.files(str(p.root / SPLITS[s]))):
            count = pq.ParquetFile(f).metadata.num_rows
            gone = drop.get(k, np.zeros(0, dtype="int64"))
            gone = gone[(gone >= start) & (gone < start + count)] - start
            target = out / f"part-{k:05d}-{n:05d}.parquet"
            if len(gone) == 0:
                _link(Path(f), target)
            else:
                table = pq.read_table(f)
                keep = np.ones(count, dtype=bool)
                keep[gone] = False
                pq.write_table(table.filter(pa.array(keep)), target, row_group_size=shards.ROW_GROUP_ROWS)
            rows += count - len(gone)
            start += count
    if not shards.files(str(out)):
        pq.write_table(fields.split_schema(info, False).empty_table(), out / "part-00000-00000.parquet")
    return Shards(dir=FlyteDirectory(str(out)), rows=rows, streamed=True, sha256=content.directory_sha256(out))


def _assemble_quarantine(ordered: list[_Part], duplicates: ShardWriter, info: DatasetInfo) -> Shards:
    """Every part's quarantine and the duplicates found across shards, in one directory."""
    closed = duplicates.close(quarantine_schema(info))
    out = output_dir("flyscale-quarantine-")
    for k, p in enumerate(ordered):
        for n, f in enumerate(shards.files(str(p.root / "quarantine"))):
            _link(Path(f), out / f"part-{k:05d}-{n:05d}.parquet")
    for n, f in enumerate(shards.files(closed.dir.path)):
        _link(Path(f), out / f"duplicates-{n:05d}.parquet")
    rows = sum(p.part.quarantined for p in ordered) + closed.rows
    return Shards(dir=FlyteDirectory(str(out)), rows=rows, sha256=content.directory_sha256(out))


def _items(info: DatasetInfo) -> str:
    return "rows" if table_examples.is_table(info) else "examples"
