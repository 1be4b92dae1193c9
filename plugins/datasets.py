"""Built-in datasets. `digits` ships inside scikit-learn: no network, 1797 8x8 images."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd
import pandera.pandas as pa

from flyscale.api import DatasetInfo

DIGITS_PIXELS = [f"pixel_{i}" for i in range(64)]


class Digits:
    """scikit-learn's handwritten digits: 64 pixel intensities in [0, 16], labels 0-9."""

    options_type = None
    default_augmentations = ("shift", "noise")

    def load(self, options: None) -> pd.DataFrame:
        # The file sklearn.datasets.load_digits reads (64 pixels, then the label, per line), read
        # here: importing scikit-learn takes 2-3 s, through scipy, in every run that loads data.
        with gzip.open(digits_file(), "rt") as f:
            data = np.loadtxt(f, delimiter=",", dtype="float32")
        frame = pd.DataFrame(data[:, :-1], columns=DIGITS_PIXELS)
        frame["label"] = data[:, -1].astype("int64")
        return frame

    def fingerprint(self, options: None) -> str:
        """The bytes `load` reads."""
        return hashlib.sha256(digits_file().read_bytes()).hexdigest()

    def info(self, options: None) -> DatasetInfo:
        return DatasetInfo(
            name="digits",
            num_classes=10,
            input_shape=[1, 8, 8],
            feature_columns=list(DIGITS_PIXELS),
            feature_ranges={c: [0.0, 16.0] for c in DIGITS_PIXELS},
        )

    def row_schema(self, options: None) -> pa.DataFrameSchema:
        pixel = pa.Column(float, checks=pa.Check.in_range(0.0, 16.0), nullable=False, coerce=True)
        return pa.DataFrameSchema(
            {**{c: pixel for c in DIGITS_PIXELS}, "label": pa.Column(int, pa.Check.isin(range(10)), coerce=True)},
            strict=True,
            name="digits",
        )


def digits_file() -> Path:
    """scikit-learn's copy of the digits, found without importing scikit-learn."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "dataset 'digits' ships inside scikit-learn, which is not installed: pip install scikit-learn"
        )
    return Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"


digits = Digits()
