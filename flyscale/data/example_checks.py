"""Checking a batch of typed examples field by field, vectorised over the batch's Arrow columns.

Each field is decoded once (an encoded image by PIL, a document from UTF-8) and checked by kind:
presence, dtype and shape, finiteness and range, decodability, empty documents, a class label's
domain (a real-valued target is checked as any other number). An example that fails a check gets
a reason naming the field, the check and what was found (`image: shape [3, 32, 32] (got [3, 28,
28])`); the others go on. What two examples are compared by, to find duplicates, is also decided
here: the decoded values of every field.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from flyscale.data import fields
from flyscale.errors import DataError
from flyscale.plugin.records import SOURCE_PROBLEM, DatasetInfo, FieldSpec


class Checked:
    """One batch, checked: each field's decoded values and each failing example's reasons.

    Values are (N, *shape) arrays of the field's dtype for fixed shapes; object arrays of `str`
    (documents) or of 1-D arrays (variable-length fields) otherwise. A failed example's values
    are zeros or empty: only the examples that pass are ever written.
    """

    def __init__(self, n: int):
        self.n = n
        self.values: dict[str, np.ndarray] = {}
        self.reasons: list[list[str]] = [[] for _ in range(n)]

    def fail(self, rows: np.ndarray, reason: Callable[[int], str]) -> None:
        """Add a reason to each example where `rows` (a boolean mask) is true."""
        for i in np.flatnonzero(rows):
            self.reasons[i].append(reason(int(i)))

    @property
    def bad(self) -> np.ndarray:
        return np.array([bool(r) for r in self.reasons], dtype=bool)

    def reason_texts(self) -> list[str]:
        return ["; ".join(r) for r in self.reasons]


def check_batch(table: pa.Table, info: DatasetInfo, where: str) -> Checked:
    """Decode and check every declared field of `table` (and the label's domain)."""
    missing = [f.name for f in info.fields if f.name not in table.column_names]
    if missing:
        raise DataError(f"{where}: examples() gave no column for the declared field(s) {missing}")
    checked = Checked(table.num_rows)
    for f in info.fields:
        check_field(table.column(f.name).combine_chunks(), f, checked)
    # A class must be one of 0..num_classes-1; a real-valued target is checked as any field is
    # (finite, and inside its range where it declares one), above.
    if info.label_column and fields.real_target(info) is None:
        labels, top = checked.values[info.label_column], info.num_classes - 1
        outside = (labels < 0) | (labels > top)
        checked.fail(outside, lambda i: f"{info.label_column}: in_range(0, {top}) (got {labels[i]})")
    if SOURCE_PROBLEM in table.column_names:  # what the dataset could not read says it all: its fields are null
        for i, problem in enumerate(table.column(SOURCE_PROBLEM).to_pylist()):
            if problem:
                checked.reasons[i] = [problem]
    return checked


def check_field(column: pa.Array, field: FieldSpec, checked: Checked) -> None:
    """Decode the field and check it; `checked` gets its values and the reasons it failed."""
    missing = column.is_null().to_numpy(zero_copy_only=False)
    checked.fail(missing, lambda i: f"{field.name}: missing (got null)")
    if field.dtype == "string":
        checked.values[field.name] = _documents(column, field, missing, checked)
    elif field.encoding != "raw":
        checked.values[field.name] = _images(column, field, missing, checked)
    elif field.variable:
        checked.values[field.name] = _sequences(column, field, missing, checked)
    elif field.shape:
        checked.values[field.name] = _arrays(column, field, missing, checked)
    else:
        raw = column.fill_null(0).to_numpy(zero_copy_only=False).reshape(len(column))
        checked.values[field.name] = _checked_cast(raw, field, np.arange(len(column)), checked)


def _is_binary(column: pa.Array) -> bool:
    return pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)


def _is_list(column: pa.Array) -> bool:
    t = column.type
    return pa.types.is_list(t) or pa.types.is_fixed_size_list(t) or pa.types.is_large_list(t)


def _documents(column: pa.Array, field: FieldSpec, missing: np.ndarray, checked: Checked) -> np.ndarray:
    """Text as `str`: binary must decode as UTF-8; a document of only whitespace is empty."""
    if not (_is_binary(column) or pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(f"field {field.name!r} is declared a string but arrives as {column.type}")
    out = np.full(len(column), "", dtype=object)
    errors: dict[int, str] = {}
    for i, value in enumerate(column.to_pylist()):
        if value is None:
            continue
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError as exc:
                errors[i] = f"byte {exc.start} is not UTF-8"
                continue
        out[i] = value
    undecodable = np.isin(np.arange(len(column)), list(errors))
    checked.fail(undecodable, lambda i: f"{field.name}: utf8 (got {errors[i]})")
    empty = ~missing & ~undecodable & np.array([not v.strip() for v in out], dtype=bool)
    checked.fail(empty, lambda i: f"{field.name}: not_empty (got {len(out[i])} blank characters)")
    return out


def _images(column: pa.Array, field: FieldSpec, missing: np.ndarray, checked: Checked) -> np.ndarray:
    """Encoded images decoded to uint8 (C, H, W); undecodable and wrongly sized ones fail."""
    if not _is_binary(column):
        raise DataError(f"field {field.name!r} is declared {field.encoding} bytes but arrives as {column.type}")
    n = len(column)
    out = np.zeros((n, *field.shape), dtype=field.dtype)
    errors: dict[int, str] = {}
    sizes: dict[int, list[int]] = {}
    for i, data in enumerate(column.to_pylist()):
        if data is None:
            continue
        try:
            out[i] = fields.decode_image(data, field)
        except fields.WrongSize as exc:  # told by the header, before decoding
            sizes[i] = exc.shape
        except ValueError as exc:
            errors[i] = str(exc)
    checked.fail(np.isin(np.arange(n), list(errors)), lambda i: f"{field.name}: decodable (got {errors[i]})")
    checked.fail(
        np.isin(np.arange(n), list(sizes)),
        lambda i: f"{field.name}: shape {field.shape} (got {_size(sizes[i], field)})",
    )
    return out


def _size(shape: list[int], field: FieldSpec) -> str:
    """An image's shape as found, with its size in pixels against the declared one and where that is set."""
    (_, height, width), (_, want_h, want_w) = shape, field.shape
    if (height, width) == (want_h, want_w):
        return str(shape)
    return (
        f"{shape}: {height}x{width} pixels, not the {want_h}x{want_w} that the dataset's height and width "
        f"options declare"
    )


def _arrays(column: pa.Array, field: FieldSpec, missing: np.ndarray, checked: Checked) -> np.ndarray:
    """A fixed-shape numeric field: every example has exactly its elements, finite and in range."""
    if not _is_list(column):
        raise DataError(f"field {field.name!r} is declared {field.dtype}{field.shape} but arrives as {column.type}")
    out = np.zeros((len(column), *field.shape), dtype=field.dtype)
    lengths = column.value_lengths().fill_null(0).to_numpy(zero_copy_only=False)
    size = fields.size(field)
    wrong = ~missing & (lengths != size)
    checked.fail(wrong, lambda i: f"{field.name}: shape {field.shape} (got {lengths[i]} elements, not {size})")
    good = ~missing & ~wrong
    if good.any():
        flat = pc.list_flatten(column.filter(pa.array(good))).to_numpy(zero_copy_only=False)
        raw = flat.reshape(int(good.sum()), *field.shape)
        out[good] = _checked_cast(raw, field, np.flatnonzero(good), checked)
    return out


def _sequences(column: pa.Array, field: FieldSpec, missing: np.ndarray, checked: Checked) -> np.ndarray:
    """A variable-length field: 1..shape[0] elements each, finite and in range."""
    if not _is_list(column):
        raise DataError(f"field {field.name!r} is declared {field} but arrives as {column.type}")
    lengths = column.value_lengths().fill_null(0).to_numpy(zero_copy_only=False)
    top = field.shape[0]
    wrong = ~missing & ((lengths < 1) | (lengths > top))
    checked.fail(wrong, lambda i: f"{field.name}: length in [1, {top}] (got {lengths[i]})")
    out = np.empty(len(column), dtype=object)
    out[:] = [np.zeros(0, dtype=field.dtype)] * len(column)
    good = ~missing & ~wrong
    if good.any():
        rows, sizes = np.flatnonzero(good), lengths[good]
        flat = pc.list_flatten(column.filter(pa.array(good))).to_numpy(zero_copy_only=False).astype("float64")
        starts = np.cumsum(sizes) - sizes
        finite = np.logical_and.reduceat(np.isfinite(flat), starts)
        safe = np.where(np.isfinite(flat), flat, 0.0)
        low, high = np.minimum.reduceat(safe, starts), np.maximum.reduceat(safe, starts)
        whole = np.logical_and.reduceat(safe == np.round(safe), starts)
        lo, hi = _range_failures(field, rows, finite, low, high, whole, checked)
        out[rows] = np.split(safe.clip(lo, hi).astype(field.dtype), starts[1:])
    return out


def _checked_cast(raw: np.ndarray, field: FieldSpec, rows: np.ndarray, checked: Checked) -> np.ndarray:
    """`raw` (the values of batch rows `rows`) cast to the field's dtype; a row that is not
    finite, or has a value outside the field's range (its dtype's, when it declares none), fails."""
    flat = raw.reshape(len(raw), -1).astype("float64")
    finite = np.isfinite(flat).all(axis=1)
    low, high = flat.min(axis=1, initial=np.inf), flat.max(axis=1, initial=-np.inf)
    whole = (np.nan_to_num(flat) == np.round(np.nan_to_num(flat))).all(axis=1)
    lo, hi = _range_failures(field, rows, finite, low, high, whole, checked)
    safe = np.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0).clip(lo, hi)
    return safe.reshape(raw.shape).astype(field.dtype)


def _range_failures(
    field: FieldSpec,
    rows: np.ndarray,
    finite: np.ndarray,
    low: np.ndarray,
    high: np.ndarray,
    whole: np.ndarray,
    checked: Checked,
) -> tuple[float, float]:
    """Fail the batch rows `rows` whose values are not all finite, not whole numbers in an
    integer field, or outside the field's range (its dtype's, when it declares none); the range,
    to clip the rest into."""
    lo, hi = field.range if field.range is not None else _dtype_range(field.dtype)
    outside = finite & ((low < lo) | (high > hi))
    fractional = finite & ~whole if field.dtype != "float32" else np.zeros_like(finite)
    at = {int(r): k for k, r in enumerate(rows)}
    for bad, reason in (
        (~finite, lambda i: f"{field.name}: finite (got NaN or inf)"),
        (fractional, lambda i: f"{field.name}: integer (got a fraction, {low[at[i]]:g}..{high[at[i]]:g})"),
        (outside, lambda i: f"{field.name}: in_range({lo:g}, {hi:g}) (got {low[at[i]]:g}..{high[at[i]]:g})"),
    ):
        mask = np.zeros(checked.n, dtype=bool)
        mask[rows[bad]] = True
        checked.fail(mask, reason)
    return lo, hi


def _dtype_range(dtype: str) -> tuple[float, float]:
    if dtype == "float32":
        return -np.inf, np.inf
    limits = np.iinfo(dtype)
    return float(limits.min), float(limits.max)


def content_hash(values: dict[str, np.ndarray], info: DatasetInfo) -> np.ndarray:
    """A 64-bit hash of each example's decoded values (every field): what a duplicate is looked
    up by, before it is confirmed by `same_content`. The same in every process (no salt)."""
    per_field = {}
    for f in info.fields:
        v = values[f.name]
        if v.dtype == object:
            items = v if f.dtype == "string" else np.array([a.tobytes() for a in v], dtype=object)
            per_field[f.name] = pd.util.hash_array(items)
        else:
            per_field[f.name] = _bytes_hash(np.ascontiguousarray(v).reshape(len(v), -1).view("uint8"))
    return pd.util.hash_pandas_object(pd.DataFrame(per_field), index=False).to_numpy()


def _bytes_hash(rows: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each row of bytes, vectorised: the bytes as uint64 words, hashed by pandas."""
    pad = (-rows.shape[1]) % 8
    words = np.pad(rows, ((0, 0), (0, pad))).view("uint64")
    return pd.util.hash_pandas_object(pd.DataFrame(words), index=False).to_numpy()


def same_content(a: dict[str, np.ndarray], b: dict[str, np.ndarray], info: DatasetInfo) -> np.ndarray:
    """Example by example, whether two equally long sets of values are the same in every field."""
    same = np.ones(len(a[info.fields[0].name]), dtype=bool)
    for f in info.fields:
        x, y = a[f.name], b[f.name]
        if x.dtype == object:
            same &= np.array([_equal(p, q) for p, q in zip(x, y, strict=True)], dtype=bool)
        else:
            same &= (x.reshape(len(x), -1) == y.reshape(len(y), -1)).all(axis=1)
    return same


def _equal(p: object, q: object) -> bool:
    if isinstance(p, np.ndarray):
        return isinstance(q, np.ndarray) and p.shape == q.shape and bool((p == q).all())
    return p == q
