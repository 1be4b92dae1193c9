"""Preparing data larger than memory: validate it chunk by chunk and split it as it streams by.

The same checks as in memory (flyscale/data/validation.py) run on each chunk the dataset hands over;
quarantined rows, and the train, validation and test splits, are written to Parquet shards as
they come, so memory holds a chunk, a bounded sample (for the profile) and the duplicate check's
row hashes with where each kept row went (16 bytes a row). A hash match is confirmed by comparing
the two rows before anything is quarantined. Rows are assigned to splits by a seeded hash of where they came from
(file and row), so the same data always splits the same way without being held in memory; at
scale that is a stratified split in all but name. Counts and the row-conservation invariant hold
exactly, whatever the size.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pandera.pandas as pa
import pyarrow
import pyarrow.parquet as pq

from flyscale.config import DataConfig
from flyscale.data import drift, shards, validation
from flyscale.data.reference import Profile, Reference
from flyscale.data.shards import Shards, ShardWriter
from flyscale.data.validation import ValidationReport
from flyscale.errors import DataError, require
from flyscale.plugin.records import SOURCE_FILE, SOURCE_ROW, DatasetInfo

log = logging.getLogger(__name__)

SAMPLE_ROWS = 100_000  # the reservoir the profile (deciles, label counts) is taken from


@dataclass
class Prepared:
    train: Shards
    val: Shards
    test: Shards
    quarantined: Shards
    report: ValidationReport
    profile: Profile
    info: DatasetInfo
    sample: pd.DataFrame  # bounded, for the report's plots


DUPLICATE = "duplicate: the same values as an earlier row"
_SPLIT_BITS = np.uint64(62)  # a location is split << 62 | position in that split


def row_hash(rows: pd.DataFrame) -> np.ndarray:
    """A 64-bit content hash per row: what a duplicate is looked up by (and then confirmed)."""
    return pd.util.hash_pandas_object(rows, index=False).to_numpy()


class SeenRows:
    """Every kept row's content hash and where it was written (its split and position there), as
    sorted runs of (hash, location), 16 bytes a row, merged as they grow."""

    def __init__(self):
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []

    def lookup(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which hashes were seen, the location of a row seen with each)."""
        found = np.zeros(len(hashes), dtype=bool)
        where = np.zeros(len(hashes), dtype="uint64")
        for keys, locations in self._runs:
            at = np.minimum(np.searchsorted(keys, hashes), len(keys) - 1)
            hit = ~found & (keys[at] == hashes)
            found |= hit
            where[hit] = locations[at[hit]]
        return found, where

    def add(self, hashes: np.ndarray, locations: np.ndarray) -> None:
        if not len(hashes):  # a shard that kept nothing: an empty run would have no last key to look at
            return
        order = np.argsort(hashes, kind="stable")
        self._runs.append((hashes[order], locations[order]))
        while len(self._runs) > 1 and len(self._runs[-1][0]) * 2 >= len(self._runs[-2][0]):
            (top_k, top_l), (below_k, below_l) = self._runs.pop(), self._runs.pop()
            keys, locations = np.concatenate([below_k, top_k]), np.concatenate([below_l, top_l])
            order = np.argsort(keys, kind="stable")
            self._runs.append((keys[order], locations[order]))


def same_rows(a: pd.DataFrame, b: pd.DataFrame) -> np.ndarray:
    """Row by row, whether two frames of the same columns hold the same values (NaN equal to NaN)."""
    a, b = a.reset_index(drop=True), b[list(a.columns)].reset_index(drop=True)
    return ((a == b) | (a.isna() & b.isna())).all(axis=1).to_numpy()


def _split_of(chunk: pd.DataFrame, cfg: DataConfig) -> np.ndarray:
    """0 train, 1 validation, 2 test, by a seeded hash of each row's origin."""
    key = f"flyscale{cfg.seed:08d}"[-16:]
    h = pd.util.hash_pandas_object(chunk[[SOURCE_FILE, SOURCE_ROW]], index=False, hash_key=key).to_numpy()
    u = (h % np.uint64(1_000_000)).astype("float64") / 1_000_000
    return np.where(u < cfg.test_fraction, 2, np.where(u < cfg.test_fraction + cfg.val_fraction, 1, 0))


def _with_origin(chunk: pd.DataFrame, offset: int, dataset: str) -> pd.DataFrame:
    if SOURCE_FILE not in chunk:
        chunk = chunk.assign(**{SOURCE_FILE: dataset, SOURCE_ROW: np.arange(offset, offset + len(chunk))})
    return chunk.set_axis(pd.RangeIndex(offset, offset + len(chunk)))


class _Kept:
    """Where the rows that passed go: the three splits, the drift counts and the profile's sample."""

    def __init__(self, cfg: DataConfig, reference: Reference, info: DatasetInfo, seed: int):
        self.cfg = cfg
        self.writers = [ShardWriter(name, streamed=True) for name in ("train", "val", "test")]
        self.drift = _DriftCounts(reference.profile, info)
        self.rng = np.random.default_rng(seed)
        self.sample: pd.DataFrame | None = None
        self.rows = 0

    def add(self, good: pd.DataFrame, origin: pd.DataFrame) -> np.ndarray:
        """Write validated rows (origin: the same rows with where they came from); their locations."""
        parts = _split_of(origin, self.cfg)
        where = np.zeros(len(good), dtype="uint64")
        for i, writer in enumerate(self.writers):
            mine = parts == i
            where[mine] = (np.uint64(i) << _SPLIT_BITS) | np.arange(
                writer.rows, writer.rows + mine.sum(), dtype="uint64"
            )
            writer.write(good[mine].reset_index(drop=True))
        self.drift.add(good)
        self.sample = _bottom_k(self.sample, good, self.rng)
        self.rows += len(good)
        return where

    def written(self) -> list[list[shards.Unit]]:
        """Close what has been written so it can be read back; each split's row groups."""
        return [shards.units(w.close().dir.path) if w.rows else [] for w in self.writers]


def prepare(
    chunks: Iterable[pd.DataFrame],
    cfg: DataConfig,
    info: DatasetInfo,
    reference: Reference,
    seed: int = 0,
    hash_rows: Callable[[pd.DataFrame], np.ndarray] = row_hash,
) -> Prepared:
    """Validate every chunk, write the quarantine and the three splits as shards, and report.

    A row whose content hash matches a row already kept is a suspect, not yet a duplicate: it is
    set aside on disk and, once every chunk is in, compared with the row it matched. Only a row
    with the same values is quarantined; a hash collision is kept like any other good row.
    """
    where = f"dataset {cfg.dataset!r}"
    pinned = validation.pin(info, reference, where)
    schema = validation.row_schema(cfg, pinned)
    columns = [*pinned.feature_columns, pinned.label_column]
    kept = _Kept(cfg, reference, pinned, seed)
    quarantine, suspects = ShardWriter("quarantine"), ShardWriter("suspects")
    seen, checks = SeenRows(), Counter[str]()
    total = 0
    for chunk in chunks:
        chunk = _with_origin(chunk, total, cfg.dataset)
        total += len(chunk)
        data = chunk[columns]
        validation.reject_schema_problems(data, pinned, where)
        validated, reasons = validation.row_failures(data, schema, where)
        candidates = data.index.difference(reasons.index)
        digest = pd.Series(hash_rows(data.loc[candidates]), index=candidates)
        earlier, first_at = seen.lookup(digest.to_numpy())
        if earlier.any():
            suspect = candidates[earlier]
            suspects.write(chunk.loc[suspect].assign(_row=suspect, _first=first_at[earlier]))
        repeats = _repeats_within(data, digest[~earlier])
        dupes = pd.Series(DUPLICATE, index=repeats, dtype="str")
        reasons = pd.concat([reasons, dupes]).sort_index()
        checks.update(name for reason in reasons for name in validation.check_names(reason))
        if len(reasons):
            quarantine.write(validation.quarantine_rows(chunk, data, reasons, cfg.dataset).astype({"row": "int64"}))
        keep = ~data.index.isin(reasons.index) & ~data.index.isin(candidates[earlier])
        if keep.any():
            good = schema.validate(data[keep], lazy=False) if validated is None else validated.loc[keep]
            seen.add(digest.loc[good.index].to_numpy(), kept.add(good, chunk.loc[good.index]))
    if total == 0:
        raise DataError(f"{where} holds no rows: there is nothing to validate or train on")
    if suspects.rows:
        _confirm(suspects.close(), kept, quarantine, checks, schema, columns, cfg.dataset)
    report = ValidationReport(
        total_rows=total,
        valid_rows=kept.rows,
        quarantined_rows=quarantine.rows,
        checks=dict(checks),
        reference=reference.source,
        pinned_classes=pinned.num_classes != info.num_classes,
    )
    require(
        report.valid_rows + report.quarantined_rows == report.total_rows,
        f"validation lost rows: {report.total_rows} in, {report.valid_rows} valid + "
        f"{report.quarantined_rows} quarantined out",
    )
    try:
        validation.enforce_ceiling(report, cfg)
    except validation.CeilingExceeded as exc:
        exc.quarantine_dir = quarantine.close().dir.path
        raise
    empty = pd.DataFrame({c: pd.Series(dtype="float64") for c in pinned.feature_columns}).assign(
        **{pinned.label_column: pd.Series(dtype="int64")}
    )
    arrow = pyarrow.Schema.from_pandas(empty, preserve_index=False)
    train, val, test = (w.close(arrow) for w in kept.writers)
    frame = kept.sample.drop(columns="_key").reset_index(drop=True) if kept.sample is not None else empty
    profile = drift.profile(frame, pinned)
    profile.rows = kept.rows
    if reference.profile is not None:
        report.drift = kept.drift.psi()
        validation.enforce_drift(report, cfg)
    log.info(
        "streamed %d rows: %d train, %d validation, %d test, %d quarantined",
        total,
        train.rows,
        val.rows,
        test.rows,
        quarantine.rows,
    )
    return Prepared(train, val, test, quarantine.close(), report, profile, pinned, frame)


def _repeats_within(data: pd.DataFrame, digest: pd.Series) -> pd.Index:
    """Rows (of `digest`'s index) with the same values as an earlier row of the same chunk: a hash
    match confirmed by comparing the two rows."""
    again = digest.duplicated(keep="first")
    if not again.any():
        return digest.index[:0]
    first = pd.Series(digest.index, index=digest.index).groupby(digest.to_numpy()).transform("first")
    rows = digest.index[again.to_numpy()]
    same = same_rows(data.loc[rows], data.loc[first.loc[rows].to_numpy()])
    return rows[same]


def _confirm(
    suspects: Shards,
    kept: _Kept,
    quarantine: ShardWriter,
    checks: Counter[str],
    schema: pa.DataFrameSchema,
    columns: list[str],
    dataset: str,
) -> None:
    """Compare each suspect with the kept row its hash matched: quarantine the same, keep the rest."""
    written = kept.written()
    mask = (np.uint64(1) << _SPLIT_BITS) - np.uint64(1)
    for unit in shards.units(suspects.dir.path):
        batch = pq.ParquetFile(unit.file).read_row_group(unit.row_group).to_pandas()
        batch = batch.set_index(pd.Index(batch.pop("_row").to_numpy(), dtype="int64"))
        first = batch.pop("_first").to_numpy().astype("uint64")
        split, position = (first >> _SPLIT_BITS).astype("int64"), first & mask
        rows = schema.validate(batch[columns], lazy=False)
        earlier = pd.concat(
            shards.take(written[s], position[split == s]).set_axis(np.flatnonzero(split == s)) for s in np.unique(split)
        ).sort_index()
        same = same_rows(rows, earlier)
        if same.any():
            dupes = pd.Series(DUPLICATE, index=batch.index[same], dtype="str")
            checks.update(validation.check_names(DUPLICATE) * len(dupes))
            quarantine.write(validation.quarantine_rows(batch, batch[columns], dupes, dataset).astype({"row": "int64"}))
        if not same.all():
            kept.add(rows[~same], batch[~same])


def _bottom_k(sample: pd.DataFrame | None, good: pd.DataFrame, rng: np.random.Generator) -> pd.DataFrame:
    """A uniform sample of at most SAMPLE_ROWS of all rows so far: the rows with the smallest random keys."""
    keyed = good.assign(_key=rng.random(len(good)))
    merged = keyed if sample is None else pd.concat([sample, keyed], ignore_index=True)
    return merged.nsmallest(SAMPLE_ROWS, "_key") if len(merged) > SAMPLE_ROWS else merged


class _DriftCounts:
    """New data's counts on the reference's bins, summed chunk by chunk."""

    def __init__(self, ref: Profile | None, info: DatasetInfo):
        self.ref, self.info = ref, info
        self.counts = {n: np.zeros(len(fp.counts), dtype="int64") for n, fp in (ref.features.items() if ref else [])}
        self.labels: Counter = Counter()

    def add(self, good: pd.DataFrame) -> None:
        if self.ref is None:
            return
        for name, fp in self.ref.features.items():
            if name in good:
                self.counts[name] += np.asarray(drift.histogram(good[name].to_numpy("float64"), np.asarray(fp.edges)))
        self.labels.update(str(k) for k in good[self.info.label_column].astype("int64"))

    def psi(self) -> dict[str, float]:
        ref = self.ref
        if ref is None:  # no reference: nothing to drift from
            return {}
        out = {n: drift.psi(ref.features[n].counts, c.tolist()) for n, c in self.counts.items()}
        classes = sorted(set(ref.labels) | set(self.labels))
        out["label"] = drift.psi([ref.labels.get(c, 0) for c in classes], [self.labels.get(c, 0) for c in classes])
        return out
