"""A table's row schema when its dataset declares none of its own.

A table dataset produces a `label` column plus numeric feature columns; its own pandera row
schema (`row_schema(options)`) decides which rows are quarantined, or `default_row_schema` for a
dataset that declares none.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pandera.pandas as pa

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
