"""`acme_wine`: a tabular dataset (scikit-learn's wine, 178 rows, 13 features, 3 classes).

It returns its own info object and declares no row schema: flyscale converts the info at the
boundary and checks rows against what it declares (finite features, labels in [0, 3)).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd


@dataclass
class WineInfo:
    """Same fields as flyscale's DatasetInfo (structural typing: nothing imported)."""

    name: str
    num_classes: int
    input_shape: tuple[int, ...]
    feature_columns: list[str]


class Wine:
    """Standardised features (z-scores), so any model trains on them without tuning."""

    def load(self, options) -> pd.DataFrame:
        from sklearn.datasets import load_wine

        bunch = load_wine(as_frame=True)
        features = (bunch.data - bunch.data.mean()) / bunch.data.std()
        return features.assign(label=bunch.target.astype("int64"))

    def info(self, options) -> WineInfo:
        from sklearn.datasets import load_wine

        columns = list(load_wine(as_frame=True).data.columns)
        return WineInfo(name="acme-wine", num_classes=3, input_shape=(len(columns),), feature_columns=columns)


wine = Wine()
