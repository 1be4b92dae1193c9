"""scikit-learn's data as typed examples: nothing is downloaded (the data ships inside
scikit-learn).

`diabetes`, for regression:

442 patients, each ten baseline measurements (age, sex, body mass index, mean blood pressure and
six blood serum measurements) and the target, a measure of the disease's progression one year
later (25 to 346 in this data). The features come as scikit-learn scales them: each column
centred and divided by its standard deviation times the square root of 442, so every column's
squares sum to 1 and no value can lie outside [-1, 1]. The target is in its own units, and so are
the predictions of a model trained on it.
"""

from __future__ import annotations

import gzip
import hashlib
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from flyscale.api import SOURCE_FILE, SOURCE_KEY, SOURCE_ROW, DatasetInfo, FieldSpec
from flyscale_plugins.datasets import digits_file

SOURCE = "sklearn.datasets.load_diabetes"
DIGITS_SOURCE = "sklearn.datasets.load_digits"
FEATURES = 10


class Diabetes:
    """`features: float32[10]` and `target: float32`, one example per patient."""

    options_type = None
    default_augmentations = ()
    objective = "regression"  # a real-valued target: what it is for (its default model name)

    def info(self, options) -> DatasetInfo:
        return DatasetInfo(
            name="diabetes",
            num_classes=1,  # a regressor's output width: one target value per example
            input_shape=[FEATURES],
            feature_columns=[],
            label_column="target",
            fields=[
                # [-1, 1]: the bound scikit-learn's scaling guarantees (each column's squares sum to 1).
                FieldSpec("features", "float32", [FEATURES], range=[-1.0, 1.0]),
                FieldSpec("target", "float32", []),
            ],
            input_field="features",
        )

    def fingerprint(self, options) -> str:
        import sklearn

        return f"{SOURCE} {sklearn.__version__}"

    def examples(self, options, shard: str) -> Iterator[pa.RecordBatch]:
        from sklearn.datasets import load_diabetes

        from flyscale.data.fields import to_arrow

        x, y = load_diabetes(return_X_y=True)
        rows = np.arange(len(y), dtype="int64")
        yield pa.record_batch(
            {
                "features": to_arrow(x.astype("float32"), self.info(options).fields[0]),
                "target": pa.array(y.astype("float32")),
                SOURCE_FILE: pa.array([SOURCE] * len(y)),
                SOURCE_ROW: pa.array(rows),
                SOURCE_KEY: pa.array([f"patient {i}" for i in rows]),
            }
        )


diabetes = Diabetes()


class DigitTokens:
    """The handwritten digits as sequences, for a sequence classifier (a Hugging Face BERT, say:
    docs/huggingface.md): each image's 64 pixel intensities, row by row, read as 64 token ids of
    a 17-id vocabulary (intensity k is id k), and its digit the label. `tokens: int32[64]` in
    [0, 16] and `label`, one example per image, in the file's order."""

    options_type = None
    default_augmentations = ()
    objective = "classification"

    def info(self, options) -> DatasetInfo:
        return DatasetInfo(
            name="digit_tokens",
            num_classes=10,
            input_shape=[64],
            feature_columns=[],
            label_column="label",
            fields=[FieldSpec("tokens", "int32", [64], range=[0, 16]), FieldSpec("label", "int64", [])],
            input_field="tokens",
        )

    def fingerprint(self, options) -> str:
        """The bytes `examples` reads (the digits dataset's own file), and how it reads them."""
        return f"digit_tokens sha256:{hashlib.sha256(digits_file().read_bytes()).hexdigest()}"

    def examples(self, options, shard: str) -> Iterator[pa.RecordBatch]:
        from flyscale.data.fields import to_arrow

        with gzip.open(digits_file(), "rt") as f:
            data = np.loadtxt(f, delimiter=",", dtype="float32")
        rows = np.arange(len(data), dtype="int64")
        yield pa.record_batch(
            {
                "tokens": to_arrow(data[:, :-1].astype("int32"), self.info(options).fields[0]),
                "label": pa.array(data[:, -1].astype("int64")),
                SOURCE_FILE: pa.array([DIGITS_SOURCE] * len(rows)),
                SOURCE_ROW: pa.array(rows),
                SOURCE_KEY: pa.array([f"image {i}" for i in rows]),
            }
        )


digit_tokens = DigitTokens()
