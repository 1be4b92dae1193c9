"""Preparing typed examples (images, ...): validate each field, quarantine what fails, drop
confirmed duplicates and split, batch by batch as the dataset hands them over.

Every check is vectorised over a batch's Arrow columns (a decode is per image, once). An
example that fails one goes to quarantine as it came, with its origin and every reason. The
splits are written as Parquet shards of the decoded fields (an image is one fixed-size-list
column), so memory holds a batch, whatever the data's size. Rows are split by a seeded hash of
their origin, as in flyscale/data/stream_prep.py, whose duplicate bookkeeping (hash, then
confirm by comparing the bytes) this shares.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from flyscale.config import DataConfig
from flyscale.data import drift, fields, shards, validation
from flyscale.data.reference import FeatureProfile, Profile, Reference
from flyscale.data.shards import ShardWriter
from flyscale.data.stream_prep import DUPLICATE, Prepared, SeenRows, _split_of
from flyscale.data.validation import ValidationReport
from flyscale.errors import DataError, require
from flyscale.plugin.contracts import SOURCE_FILE, SOURCE_ROW, DatasetInfo, FieldSpec

log = logging.getLogger(__name__)

INTENSITY_EDGES = np.linspace(0, 255, 11)  # an image channel's drift histogram: ten bins of intensity
SAMPLE_ROWS = 10_000  # labels kept for the report's plot


def row_bytes(columns: list[np.ndarray]) -> np.ndarray:
    """Each example's values as one row of bytes (N, B): what duplicates are hashed and compared by."""
    return np.concatenate([np.ascontiguousarray(c).reshape(len(c), -1).view("uint8") for c in columns], axis=1)


def bytes_hash(rows: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each row of bytes, vectorised: the bytes as uint64 words, hashed by pandas."""
    pad = (-rows.shape[1]) % 8
    words = np.pad(rows, ((0, 0), (0, pad))).view("uint64")
    return pd.util.hash_pandas_object(pd.DataFrame(words), index=False).to_numpy()


class _Checked:
    """One batch, checked: each field's decoded values and each failing row's reasons."""

    def __init__(self, n: int):
        self.values: dict[str, np.ndarray] = {}
        self.reasons: list[list[str]] = [[] for _ in range(n)]

    def fail(self, rows: np.ndarray, reason: Callable[[int], str]) -> None:
        for i in np.flatnonzero(rows):
            self.reasons[i].append(reason(int(i)))

    @property
    def bad(self) -> np.ndarray:
        return np.array([bool(r) for r in self.reasons], dtype=bool)


def check_field(column: pa.Array, field: FieldSpec, checked: _Checked) -> None:
    """Decode the field and check its type, shape, finiteness and range; `checked` gets both."""
    n, name = len(column), field.name
    out = np.zeros((n, *field.shape), dtype=field.dtype)
    missing = column.is_null().to_numpy(zero_copy_only=False)
    checked.fail(missing, lambda i: f"{name}: missing (got null)")
    if field.encoding != "raw":
        if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
            raise DataError(f"field {name!r} is declared {field.encoding} bytes but arrives as {column.type}")
        errors: dict[int, str] = {}
        sizes: dict[int, list[int]] = {}
        for i, data in enumerate(column.to_pylist()):
            if data is None:
                continue
            try:
                image = fields.decode_image(data, field)
            except ValueError as exc:
                errors[i] = str(exc)
                continue
            if list(image.shape) == list(field.shape):
                out[i] = image
            else:
                sizes[i] = list(image.shape)
        checked.fail(np.isin(np.arange(n), list(errors)), lambda i: f"{name}: decodable (got {errors[i]})")
        checked.fail(np.isin(np.arange(n), list(sizes)), lambda i: f"{name}: shape {field.shape} (got {sizes[i]})")
    elif field.shape:
        if not (
            pa.types.is_list(column.type)
            or pa.types.is_fixed_size_list(column.type)
            or pa.types.is_large_list(column.type)
        ):
            raise DataError(f"field {name!r} is declared {field.dtype}{field.shape} but arrives as {column.type}")
        lengths = column.value_lengths().fill_null(0).to_numpy(zero_copy_only=False)
        size = fields.size(field)
        wrong = ~missing & (lengths != size)
        checked.fail(wrong, lambda i: f"{name}: shape {field.shape} (got {lengths[i]} elements, not {size})")
        good = ~missing & ~wrong
        if good.any():
            flat = pa.compute.list_flatten(column.filter(pa.array(good))).to_numpy(zero_copy_only=False)
            raw = flat.reshape(int(good.sum()), *field.shape)
            out[good] = _checked_cast(raw, field, np.flatnonzero(good), checked)
    else:
        raw = column.fill_null(0).to_numpy(zero_copy_only=False)
        out[:] = _checked_cast(raw.reshape(n), field, np.arange(n), checked)
    checked.values[name] = out


def _checked_cast(raw: np.ndarray, field: FieldSpec, rows: np.ndarray, checked: _Checked) -> np.ndarray:
    """`raw` (the values of batch rows `rows`) cast to the field's dtype; a row that is not
    finite, or has a value outside the field's range (its dtype's, when it declares none), fails."""
    flat = raw.reshape(len(raw), -1).astype("float64")
    finite = np.isfinite(flat).all(axis=1)
    low, high = flat.min(axis=1, initial=np.inf), flat.max(axis=1, initial=-np.inf)
    lo, hi = field.range if field.range is not None else _dtype_range(field.dtype)
    outside = finite & ((low < lo) | (high > hi))
    at = {int(r): k for k, r in enumerate(rows)}
    n = len(checked.reasons)
    checked.fail(np.isin(np.arange(n), rows[~finite]), lambda i: f"{field.name}: finite (got NaN or inf)")
    checked.fail(
        np.isin(np.arange(n), rows[outside]),
        lambda i: f"{field.name}: in_range({lo:g}, {hi:g}) (got {low[at[i]]:g}..{high[at[i]]:g})",
    )
    safe = np.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0).clip(lo, hi)
    return safe.reshape(raw.shape).astype(field.dtype)


def _dtype_range(dtype: str) -> tuple[float, float]:
    if dtype == "float32":
        return -np.inf, np.inf
    limits = np.iinfo(dtype)
    return float(limits.min), float(limits.max)


class _Kept:
    """The three split writers; each kept example's location (split << 62 | position)."""

    def __init__(self, cfg: DataConfig, info: DatasetInfo):
        self.cfg, self.info = cfg, info
        self.writers = [ShardWriter(name, streamed=True) for name in ("train", "val", "test")]
        self.labels: Counter[str] = Counter()
        self.channels: dict[str, np.ndarray] = {}
        self.rows = 0

    def add(self, values: dict[str, np.ndarray], origin: pd.DataFrame) -> np.ndarray:
        parts = _split_of(origin, self.cfg)
        where = np.zeros(len(origin), dtype="uint64")
        for i, writer in enumerate(self.writers):
            mine = parts == i
            start = writer.rows
            where[mine] = (np.uint64(i) << np.uint64(62)) | np.arange(start, start + mine.sum(), dtype="uint64")
            columns = {f.name: fields.to_arrow(values[f.name][mine], f) for f in self.info.fields}
            writer.write(pa.table(columns))
        self._profile(values)
        self.rows += len(origin)
        return where

    def _profile(self, values: dict[str, np.ndarray]) -> None:
        self.labels.update(str(k) for k in values[self.info.label_column].tolist())
        image = self.info.input()
        if image is None or image.dtype != "uint8" or len(image.shape) != 3:
            return
        pixels = values[image.name]
        for c in range(image.shape[0]):
            name = f"{image.name}[c{c}]"
            counts = np.asarray(drift.histogram(pixels[:, c].reshape(-1), INTENSITY_EDGES))
            self.channels[name] = self.channels.get(name, 0) + counts

    def profile(self) -> Profile:
        edges = [float(e) for e in INTENSITY_EDGES]
        features = {n: FeatureProfile(edges=edges, counts=c.tolist()) for n, c in self.channels.items()}
        labels = {str(k): int(self.labels.get(str(k), 0)) for k in range(self.info.num_classes)}
        return Profile(rows=self.rows, features=features, labels=labels)

    def close(self) -> list[shards.Shards]:
        schema = pa.schema([(f.name, fields.arrow_type(f)) for f in self.info.fields])
        return [w.close(schema) for w in self.writers]


def prepare(
    batches: Iterable[pa.RecordBatch],
    cfg: DataConfig,
    info: DatasetInfo,
    reference: Reference,
    hash_rows: Callable[[np.ndarray], np.ndarray] = bytes_hash,
) -> Prepared:
    """Validate every batch field by field, quarantine failures and confirmed duplicates with
    their origin and reason, and write the three splits as shards of the decoded fields."""
    where = f"dataset {cfg.dataset!r}"
    kept, quarantine, suspects = _Kept(cfg, info), ShardWriter("quarantine"), ShardWriter("suspects")
    seen, checks = SeenRows(), Counter[str]()
    total = 0
    for batch in batches:
        table = pa.Table.from_batches([batch]) if isinstance(batch, pa.RecordBatch) else batch
        n = table.num_rows
        origin = _origin(table, total, cfg.dataset)
        missing = [f.name for f in info.fields if f.name not in table.column_names]
        if missing:
            raise DataError(f"{where}: examples() gave no column for the declared field(s) {missing}")
        checked = _Checked(n)
        for f in info.fields:
            check_field(table.column(f.name).combine_chunks(), f, checked)
        _check_labels(checked, info)
        ok = ~checked.bad
        content = row_bytes([checked.values[f.name] for f in info.fields])
        digest = hash_rows(content)
        earlier, first_at = seen.lookup(digest)
        earlier &= ok
        again = ok & ~earlier & _repeats_within(digest, content, ok & ~earlier)
        checked.fail(again, lambda i: DUPLICATE)
        reasons = ["; ".join(r) for r in checked.reasons]
        bad = checked.bad
        checks.update(name for r in np.array(reasons, dtype=object)[bad] for name in validation.check_names(r))
        if bad.any():
            quarantine.write(_quarantined(table, origin, bad, [r for r, b in zip(reasons, bad) if b]))
        if earlier.any():
            suspects.write(
                _with_origin(table, origin)
                .filter(pa.array(earlier))
                .append_column("_first", pa.array(first_at[earlier]))
            )
        keep = ~bad & ~earlier
        if keep.any():
            values = {k: v[keep] for k, v in checked.values.items()}
            seen.add(digest[keep], kept.add(values, origin[keep].reset_index(drop=True)))
        total += n
    if total == 0:
        raise DataError(f"{where} holds no examples: there is nothing to validate or train on")
    if suspects.rows:
        _confirm(suspects.close(), kept, quarantine, checks, info)
    report = ValidationReport(
        total_rows=total,
        valid_rows=kept.rows,
        quarantined_rows=quarantine.rows,
        checks=dict(checks),
        reference=reference.source,
    )
    require(
        report.valid_rows + report.quarantined_rows == report.total_rows,
        f"validation lost examples: {report.total_rows} in, {report.valid_rows} valid + "
        f"{report.quarantined_rows} quarantined out",
    )
    try:
        validation.enforce_ceiling(report, cfg)
    except validation.CeilingExceeded as exc:
        exc.quarantine_dir = quarantine.close().dir.path
        raise
    train, val, test = kept.close()
    profile = kept.profile()
    if reference.profile is not None:
        report.drift = _drift(profile, reference.profile)
        validation.enforce_drift(report, cfg)
    log.info(
        "prepared %d examples: %d train, %d validation, %d test, %d quarantined",
        total,
        train.rows,
        val.rows,
        test.rows,
        quarantine.rows,
    )
    sample = pd.DataFrame(
        {
            info.label_column: np.repeat(
                np.arange(info.num_classes), [profile.labels[str(k)] for k in range(info.num_classes)]
            )[:SAMPLE_ROWS]
        }
    )
    return Prepared(train, val, test, quarantine.close(), report, profile, info, sample)


def _check_labels(checked: _Checked, info: DatasetInfo) -> None:
    labels, top = checked.values[info.label_column], info.num_classes - 1
    checked.fail((labels < 0) | (labels > top), lambda i: f"{info.label_column}: in_range(0, {top}) (got {labels[i]})")


def _drift(new: Profile, ref: Profile) -> dict[str, float]:
    """PSI of each image channel's intensity histogram and of the labels, against the reference."""
    out = {n: drift.psi(ref.features[n].counts, p.counts) for n, p in new.features.items() if n in ref.features}
    classes = sorted(set(ref.labels) | set(new.labels))
    out["label"] = drift.psi([ref.labels.get(c, 0) for c in classes], [new.labels.get(c, 0) for c in classes])
    return out


def _origin(table: pa.Table, offset: int, dataset: str) -> pd.DataFrame:
    """Where each example came from: the dataset's origin columns, or its name and position."""
    if SOURCE_FILE in table.column_names:
        return pd.DataFrame(
            {
                SOURCE_FILE: table.column(SOURCE_FILE).to_numpy(zero_copy_only=False).astype(str),
                SOURCE_ROW: table.column(SOURCE_ROW).to_numpy(zero_copy_only=False).astype("int64"),
            }
        )
    return pd.DataFrame({SOURCE_FILE: dataset, SOURCE_ROW: np.arange(offset, offset + table.num_rows)})


def _with_origin(table: pa.Table, origin: pd.DataFrame) -> pa.Table:
    table = table.drop_columns([c for c in (SOURCE_FILE, SOURCE_ROW) if c in table.column_names])
    return table.append_column(SOURCE_FILE, pa.array(origin[SOURCE_FILE])).append_column(
        SOURCE_ROW, pa.array(origin[SOURCE_ROW])
    )


def _quarantined(table: pa.Table, origin: pd.DataFrame, bad: np.ndarray, reasons: list[str]) -> pa.Table:
    """The failing examples as they came, with where they came from and why."""
    rows = _with_origin(table, origin).filter(pa.array(bad))
    return rows.append_column("reason", pa.array(reasons, pa.string()))


def _repeats_within(digest: np.ndarray, content: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Candidates with the same bytes as an earlier candidate of the batch (hash, then compare)."""
    out = np.zeros(len(digest), dtype=bool)
    idx = np.flatnonzero(candidates)
    if len(idx) < 2:
        return out
    series = pd.Series(digest[idx])
    again = series.duplicated(keep="first").to_numpy()
    if not again.any():
        return out
    first = pd.Series(idx).groupby(digest[idx]).transform("first").to_numpy()
    rows, firsts = idx[again], first[again]
    out[rows] = (content[rows] == content[firsts]).all(axis=1)
    return out


def _confirm(suspects: shards.Shards, kept: _Kept, quarantine: ShardWriter, checks: Counter[str], info: DatasetInfo):
    """Compare each suspect with the kept example its hash matched: quarantine the same, keep the rest."""
    written = [shards.units(w.close().dir.path) if w.rows else [] for w in kept.writers]
    mask = (np.uint64(1) << np.uint64(62)) - np.uint64(1)
    for unit in shards.units(suspects.dir.path):
        table = pq.ParquetFile(unit.file).read_row_group(unit.row_group)
        first = table.column("_first").to_numpy().astype("uint64")
        table = table.drop_columns(["_first"])
        split, position = (first >> np.uint64(62)).astype("int64"), first & mask
        checked = _Checked(table.num_rows)
        for f in info.fields:
            check_field(table.column(f.name).combine_chunks(), f, checked)
        mine = row_bytes([checked.values[f.name] for f in info.fields])
        theirs = np.zeros_like(mine)
        for s in np.unique(split):
            at = split == s
            earlier = shards.take(written[s], position[at])
            theirs[at] = row_bytes(
                [
                    fields.to_numpy(pa.array(earlier[f.name]), f)
                    if f.shape
                    else earlier[f.name].to_numpy().astype(f.dtype)
                    for f in info.fields
                ]
            )
        same = (mine == theirs).all(axis=1)
        origin = table.select([SOURCE_FILE, SOURCE_ROW]).to_pandas()
        if same.any():
            checks.update(validation.check_names(DUPLICATE) * int(same.sum()))
            quarantine.write(_quarantined(table, origin, same, [DUPLICATE] * int(same.sum())))
        if not same.all():
            values = {k: v[~same] for k, v in checked.values.items()}
            kept.add(values, origin[~same].reset_index(drop=True))
