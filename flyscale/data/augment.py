"""Augmentation by the configured plugins: for a table, augmented copies of the training rows
written beside them (a pure function of the rows and the config); for typed examples (images),
each training batch transformed as it is drawn (`Augment`), seeded by where it is drawn, so no
copy is ever stored and every epoch sees new variants."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from flyscale.config import AugmentConfig
from flyscale.plugin.records import DatasetInfo
from flyscale.plugin.registry import Resolved

log = logging.getLogger(__name__)


def augment(train: pd.DataFrame, info: DatasetInfo, cfg: AugmentConfig) -> pd.DataFrame:
    """Originals plus `cfg.copies` augmented copies of each row; a pure function of (rows, cfg).

    Augmented values are clipped into the dataset's declared `feature_ranges`, so augmented rows
    stay inside the schema the originals passed.
    """
    if cfg.names is None:
        raise ValueError(
            "augment.names is unset: build the config as a PipelineConfig, which fills in the dataset's defaults"
        )
    if cfg.copies == 0 or not cfg.names:
        return train.copy()
    rng = np.random.default_rng(cfg.seed)
    x = train[info.feature_columns].to_numpy(dtype="float32").reshape(-1, *info.input_shape)
    lo, hi = _bounds(info)
    copies = []
    for _ in range(cfg.copies):
        out = apply(cfg.plugins, x.copy(), rng)
        flat = np.clip(out.reshape(len(out), -1), lo, hi)
        frame = pd.DataFrame(flat, columns=info.feature_columns)
        frame[info.label_column] = train[info.label_column].to_numpy()
        copies.append(frame)
    return pd.concat([train, *copies], ignore_index=True)


def apply(plugins: Sequence[Resolved], x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """`x` through each augmentation in turn, each held to returning a batch of the same shape."""
    for r in plugins:
        result = r.plugin(x, rng, r.options)
        if not isinstance(result, np.ndarray) or result.shape != x.shape:
            got = getattr(result, "shape", type(result).__name__)
            raise TypeError(
                f"augmentation {r.name!r} returned {got} for a batch of shape {x.shape}; "
                "it must return an array of the same shape"
            )
        x = result.astype("float32", copy=False)
    return x


def _bounds(info: DatasetInfo) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature (min, max) from the dataset's declared ranges; unbounded where it declares none."""
    ranges = [info.feature_ranges.get(c, (-np.inf, np.inf)) for c in info.feature_columns]
    return np.array([r[0] for r in ranges], dtype="float32"), np.array([r[1] for r in ranges], dtype="float32")


@dataclass(frozen=True)
class Augment:
    """The augmentations applied to each training batch of typed examples as it is drawn.

    A batch's randomness is a pure function of the seed and `key`: (epoch, rank, DataLoader
    worker, batch) when streamed, (epoch, rank, 0, batch) in memory. Values are clipped back
    into what the model takes of the field ([0, 1] for an image's pixels).
    """

    plugins: tuple[Resolved, ...]
    seed: int
    low: float
    high: float

    def __call__(self, x: np.ndarray, key: Sequence[int]) -> np.ndarray:
        x = apply(self.plugins, x, np.random.default_rng([self.seed, *key]))
        return np.clip(x, self.low, self.high, out=x if x.flags.writeable else None)


def on_the_fly(cfg: AugmentConfig, info: DatasetInfo) -> Augment | None:
    """What augments a dataset of typed examples' training batches (None: nothing, or a table)."""
    field = info.input()
    if field is None or not cfg.plugins:
        return None
    if field.dtype == "uint8":
        low, high = 0.0, 1.0  # what the reader makes of uint8 pixels
    elif field.range is not None:
        low, high = field.range
    else:
        low, high = -np.inf, np.inf
    return Augment(tuple(cfg.plugins), cfg.seed, float(low), float(high))
