"""The pandera schemas at task boundaries (`pandera.typing.DataFrame[...]`).

Every dataset plugin produces a `label` column plus numeric feature columns; the dataset's own
row schema (plugins) decides which rows are quarantined. These boundary schemas state what every
stage after validation may rely on, whichever dataset is in use.
"""

from __future__ import annotations

import pandera.pandas as pa
from pandera.typing import Series


class LabeledFrame(pa.DataFrameModel):
    """Clean rows: an int label >= 0, every other column a finite number."""

    label: Series[int] = pa.Field(ge=0)

    @pa.dataframe_check(error="every feature column must be numeric and finite")
    def features_finite(cls, df):  # noqa: N805 (pandera passes the class)
        import numpy as np

        feats = df.drop(columns=["label"])
        if not all(np.issubdtype(t, np.number) for t in feats.dtypes):
            return False
        return bool(np.isfinite(feats.to_numpy(dtype="float64")).all())

    class Config:
        strict = False
        coerce = True


class QuarantineFrame(pa.DataFrameModel):
    """Rejected rows, kept with why they were rejected (never silently dropped)."""

    row: Series[int] = pa.Field(ge=0)  # index of the row in the loaded dataset
    reason: Series[str]

    class Config:
        strict = False
