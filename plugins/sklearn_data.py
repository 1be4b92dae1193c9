"""scikit-learn's diabetes data as typed examples, for regression: nothing is downloaded (the data
ships inside scikit-learn).

442 patients, each ten baseline measurements (age, sex, body mass index, mean blood pressure and
six blood serum measurements) and the target, a measure of the disease's progression one year
later (25 to 346 in this data). The features come as scikit-learn scales them: each column
centred and divided by its standard deviation times the square root of 442, so every column's
squares sum to 1 and no value can lie outside [-1, 1]. The target is in its own units, and so are
the predictions of a model trained on it.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from flyscale.api import SOURCE_FILE, SOURCE_KEY, SOURCE_ROW, DatasetInfo, FieldSpec

SOURCE = "sklearn.datasets.load_diabetes"
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
