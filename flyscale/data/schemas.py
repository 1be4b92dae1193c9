"""The pandera schemas at task boundaries (`pandera.typing.DataFrame[...]`).

Every dataset plugin produces a `label` column plus numeric feature columns; the dataset's own
row schema decides which rows are quarantined (`default_row_schema` for a dataset that declares
none). The boundary schemas state what every stage after validation may rely on, whichever
dataset is in use.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pandera.pandas as pa
from pandera.typing import Series

from flyscale.plugin.records import DatasetInfo


def default_row_schema(info: DatasetInfo) -> pa.DataFrameSchema:
    """The row checks for a dataset without a `row_schema` of its own, from what its info declares.

    Features: numbers, present, finite, inside `feature_ranges` where declared. Label: a whole
    number in [0, num_classes). No other column. Each failing row goes to quarantine.
    """
    finite = pa.Check(lambda s: np.isfinite(s.astype("float64")), name="finite")
    columns = {}
    for name in info.feature_columns:
        checks = [finite]
        if name in info.feature_ranges:
            checks.append(pa.Check.in_range(*info.feature_ranges[name]))
        columns[name] = pa.Column(float, checks=checks, nullable=False, coerce=True)

    def whole_class(s: pd.Series) -> pd.Series:
        v = pd.to_numeric(s, errors="coerce")  # text becomes NaN and fails
        return (v >= 0) & (v < info.num_classes) & (v == np.floor(v))

    # No dtype coercion for the label: casting 1.5 to int would silently make it class 1.
    columns[info.label_column] = pa.Column(
        None, pa.Check(whole_class, name=f"class in [0, {info.num_classes})"), nullable=False
    )
    return pa.DataFrameSchema(columns, strict=True, name=info.name)


class LabeledFrame(pa.DataFrameModel):
    """Clean rows: an int label >= 0, every other column a finite number."""

    label: Series[int] = pa.Field(ge=0)

    @pa.dataframe_check(error="every feature column must be numeric and finite")
    def features_finite(cls, df):
        import numpy as np

        feats = df.drop(columns=["label"])
        if not all(np.issubdtype(t, np.number) for t in feats.dtypes):
            return False
        return bool(np.isfinite(feats.to_numpy(dtype="float64")).all())

    class Config:
        strict = False
        coerce = True


class QuarantineFrame(pa.DataFrameModel):
    """Rejected rows as they came in, with where they came from and why (never silently dropped)."""

    row: Series[int] = pa.Field(ge=0)  # index of the row in the loaded dataset
    source_file: Series[str]  # the file (or the dataset's name) the row came from
    source_row: Series[int] = pa.Field(ge=0)  # its row number in that file
    reason: Series[str]

    class Config:
        strict = False
