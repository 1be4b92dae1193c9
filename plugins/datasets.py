"""Built-in datasets. `digits` ships inside scikit-learn: no network, 1797 8x8 images."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import pandas as pd
import pandera.pandas as pa

from flyscale.api import DatasetInfo

DIGITS_PIXELS = [f"pixel_{i}" for i in range(64)]


class Digits:
    """scikit-learn's handwritten digits: 64 pixel intensities in [0, 16], labels 0-9."""

    options_type = None
    default_augmentations = ("shift", "noise")

    def load(self, options: None) -> pd.DataFrame:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        frame = pd.DataFrame(bunch.data.astype("float32"), columns=DIGITS_PIXELS)
        frame["label"] = bunch.target.astype("int64")
        return frame

    def fingerprint(self, options: None) -> str:
        """The bytes `load_digits` reads, found without importing scikit-learn (a second's import)."""
        root = Path(importlib.util.find_spec("sklearn").submodule_search_locations[0])
        return hashlib.sha256((root / "datasets" / "data" / "digits.csv.gz").read_bytes()).hexdigest()

    def info(self, options: None) -> DatasetInfo:
        return DatasetInfo(
            name="digits", num_classes=10, input_shape=[1, 8, 8], feature_columns=list(DIGITS_PIXELS),
            feature_ranges={c: [0.0, 16.0] for c in DIGITS_PIXELS},
        )

    def row_schema(self, options: None) -> pa.DataFrameSchema:
        pixel = pa.Column(float, checks=pa.Check.in_range(0.0, 16.0), nullable=False, coerce=True)
        return pa.DataFrameSchema(
            {**{c: pixel for c in DIGITS_PIXELS}, "label": pa.Column(int, pa.Check.isin(range(10)), coerce=True)},
            strict=True,
            name="digits",
        )


digits = Digits()
