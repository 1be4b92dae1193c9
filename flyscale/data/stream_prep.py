"""Preparing data larger than memory: validate it chunk by chunk and split it as it streams by.

The same checks as in memory (flyscale/data/validation.py) run on each chunk the dataset hands over;
quarantined rows, and the train, validation and test splits, are written to Parquet shards as
they come, so memory holds a chunk, a bounded sample (for the profile) and the duplicate check's
row hashes (8 bytes a row). Rows are assigned to splits by a seeded hash of where they came from
(file and row), so the same data always splits the same way without being held in memory; at
scale that is a stratified split in all but name. Counts and the row-conservation invariant hold
exactly, whatever the size.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow

from flyscale.config import DataConfig
from flyscale.data import drift, validation
from flyscale.data.reference import Profile, Reference
from flyscale.data.shards import Shards, ShardWriter
from flyscale.data.validation import ValidationReport
from flyscale.errors import DataError, require
from flyscale.plugin.contracts import SOURCE_FILE, SOURCE_ROW, DatasetInfo

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


class SeenRows:
    """Content hashes of every row seen, as sorted uint64 runs (8 bytes a row), merged as they grow."""

    def __init__(self):
        self._runs: list[np.ndarray] = []

    def contains(self, hashes: np.ndarray) -> np.ndarray:
        found = np.zeros(len(hashes), dtype=bool)
        for run in self._runs:
            at = np.searchsorted(run, hashes)
            found |= run[np.minimum(at, len(run) - 1)] == hashes
        return found

    def add(self, hashes: np.ndarray) -> None:
        self._runs.append(np.sort(hashes))
        while len(self._runs) > 1 and len(self._runs[-1]) * 2 >= len(self._runs[-2]):
            top, below = self._runs.pop(), self._runs.pop()
            self._runs.append(np.sort(np.concatenate([below, top])))


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


def prepare(
    chunks: Iterable[pd.DataFrame], cfg: DataConfig, info: DatasetInfo, reference: Reference, seed: int = 0
) -> Prepared:
    """Validate every chunk, write the quarantine and the three splits as shards, and report."""
    where = f"dataset {cfg.dataset!r}"
    pinned = validation.pin(info, reference, where)
    schema = validation.row_schema(cfg, pinned)
    columns = [*pinned.feature_columns, pinned.label_column]
    writers = [ShardWriter(name, streamed=True) for name in ("train", "val", "test")]
    quarantine = ShardWriter("quarantine")
    seen, checks = SeenRows(), Counter[str]()
    rng = np.random.default_rng(seed)
    sample: pd.DataFrame | None = None
    total = valid = 0
    drift_counts = _DriftCounts(reference.profile, pinned)
    for chunk in chunks:
        chunk = _with_origin(chunk, total, cfg.dataset)
        total += len(chunk)
        data = chunk[columns]
        validation.reject_schema_problems(data, pinned, where)
        validated, reasons = validation.row_failures(data, schema, where)
        candidates = data.index.difference(reasons.index)
        digest = pd.util.hash_pandas_object(data.loc[candidates], index=False).to_numpy()
        repeat = seen.contains(digest) | pd.Series(digest).duplicated(keep="first").to_numpy()
        seen.add(digest[~repeat])
        dupes = pd.Series("duplicate: the same values as an earlier row", index=candidates[repeat], dtype="str")
        reasons = pd.concat([reasons, dupes]).sort_index()
        checks.update(name for reason in reasons for name in validation.check_names(reason))
        if len(reasons):
            quarantine.write(validation.quarantine_rows(chunk, data, reasons, cfg.dataset).astype({"row": "int64"}))
        keep = ~data.index.isin(reasons.index)
        good = (
            (schema.validate(data[keep], lazy=False) if validated is None else validated.loc[keep])
            if keep.any()
            else data.iloc[0:0]
        )
        valid += len(good)
        if len(good):
            parts = _split_of(chunk.loc[good.index], cfg)
            for i, writer in enumerate(writers):
                writer.write(good[parts == i].reset_index(drop=True))
            drift_counts.add(good)
            sample = _bottom_k(sample, good, rng)
    if total == 0:
        raise DataError(f"{where} holds no rows: there is nothing to validate or train on")
    report = ValidationReport(
        total_rows=total,
        valid_rows=valid,
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
    train, val, test = (w.close(arrow) for w in writers)
    frame = sample.drop(columns="_key").reset_index(drop=True) if sample is not None else empty
    profile = drift.profile(frame, pinned)
    profile.rows = valid
    if reference.profile is not None:
        report.drift = drift_counts.psi()
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
