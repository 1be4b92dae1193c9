"""A table as typed examples: each numeric column a scalar field, so that a table larger than
memory is prepared by the same shard, check and combine steps as images and documents.

- `fields_of(info)`: the table's info with a field per feature column (float32, inside its
  declared range) and one for the label (int64: a table's label is a class). Its
  `input_field` stays empty: models take the feature columns stacked, in their declared order,
  as they always have (flyscale.data.fields.Reader).
- `batches(frames, info, where)`: the plugin's DataFrames as Arrow tables of those columns (and
  the origin columns it gave), text where numbers belong rejected first, naming the column.
- `check(table, info, schema, where)`: the table's pandera row schema (its own, or the one its
  info implies) run on each batch, so quarantine reasons name the column and the check exactly
  as validating the whole table in memory does.
- `as_table(info)`: the info handed on after preparation, without the per-column fields: what
  training, the reference and the model's description read for a table.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace

import numpy as np
import pandas as pd
import pandera.pandas as pa
import pyarrow

from flyscale.data import validation
from flyscale.data.example_checks import Checked
from flyscale.errors import DataError
from flyscale.plugin.records import SOURCE_FILE, SOURCE_ROW, DatasetInfo, FieldSpec


def is_table(info: DatasetInfo) -> bool:
    """Whether `info` is a table's (its fields, if any, only its columns: no input field)."""
    return info.input() is None and bool(info.feature_columns)


def fields_of(info: DatasetInfo) -> DatasetInfo:
    """A table's info with one scalar field per column; the info of typed examples as it is."""
    if info.fields or not is_table(info):
        return info
    features = [FieldSpec(c, "float32", [], range=info.feature_ranges.get(c)) for c in info.feature_columns]
    return replace(info, fields=[*features, FieldSpec(info.label_column, "int64", [])])


def as_table(info: DatasetInfo) -> DatasetInfo:
    """The table's info without its per-column fields (typed examples' info as it is)."""
    return replace(info, fields=[]) if is_table(info) else info


def columns(info: DatasetInfo) -> list[str]:
    return [*info.feature_columns, info.label_column]


def batches(frames: Iterable[pd.DataFrame], info: DatasetInfo, where: str) -> Iterator[pyarrow.Table]:
    """Each DataFrame as an Arrow table of the table's columns and the origin columns it has."""
    wanted = columns(info)
    for frame in frames:
        missing = [c for c in wanted if c not in frame.columns]
        if missing:
            raise DataError(f"{where} does not match its schema: missing column(s) {', '.join(map(repr, missing))}")
        validation.reject_schema_problems(frame, info, where)
        kept = [*wanted, *(c for c in (SOURCE_FILE, SOURCE_ROW) if c in frame.columns)]
        yield pyarrow.Table.from_pandas(frame[kept], preserve_index=False)


def check(table: pyarrow.Table, info: DatasetInfo, schema: pa.DataFrameSchema, where: str) -> Checked:
    """The row schema on one batch: each failing row's reasons, and every row's values as its
    fields hold them (a failing row's are zeros: it is never written)."""
    frame = table.select(columns(info)).to_pandas()
    _, reasons = validation.row_failures(frame, schema, where)
    checked = Checked(len(frame))
    for row, reason in reasons.items():
        checked.reasons[int(row)] = reason.split("; ")
    bad = checked.bad
    for f in info.fields:
        values = pd.to_numeric(frame[f.name], errors="coerce").to_numpy(dtype="float64")
        values[bad | ~np.isfinite(values)] = 0
        checked.values[f.name] = values.astype(f.dtype)
    return checked
