"""Data preparation as plain functions on DataFrames: fingerprint, load, split, augment
(validation with quarantine is flyscale/validation.py)."""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pandas as pd
import torch

from flyscale import shards
from flyscale.config import AugmentConfig, DataConfig
from flyscale.contracts import DatasetInfo, as_dataset_info
from flyscale.shards import Shards
from flyscale.streaming import Stream, read_unit
from flyscale.training import TrainData

log = logging.getLogger(__name__)


@dataclass
class DataFingerprint:
    """The identity of the data a run reads, taken when the run starts; loading is keyed on it."""

    dataset: str
    value: str  # sha256, hex
    method: str  # how it was taken, for the summary and MLflow


def frame_hash(frame: pd.DataFrame) -> str:
    """sha256 of a frame's content: values, index, column names and dtypes."""
    digest = hashlib.sha256(pd.util.hash_pandas_object(frame, index=True).to_numpy().tobytes())
    digest.update(repr([(str(c), str(t)) for c, t in frame.dtypes.items()]).encode())
    return digest.hexdigest()


def fingerprint(cfg: DataConfig) -> DataFingerprint:
    """The dataset's own fingerprint when it has one, else the hash of everything it loads."""
    r = cfg.plugin
    if hasattr(r.plugin, "fingerprint"):
        identity = r.plugin.fingerprint(r.options)
        if not isinstance(identity, str) or not identity:
            raise TypeError(f"dataset {cfg.dataset!r}: fingerprint() returned {identity!r}; expected a non-empty str")
        value, method = hashlib.sha256(identity.encode()).hexdigest(), f"dataset {cfg.dataset!r}: its fingerprint()"
    else:
        frame, _ = load(cfg)
        value, method = frame_hash(frame), f"dataset {cfg.dataset!r}: content of {len(frame)} rows (no fingerprint())"
    return DataFingerprint(dataset=cfg.dataset, value=value, method=method)


def content_fingerprint(frame: pd.DataFrame, cfg: DataConfig) -> DataFingerprint:
    """The fingerprint of what was loaded: the same bytes give the same one, however they got there."""
    return DataFingerprint(cfg.dataset, frame_hash(frame), f"dataset {cfg.dataset!r}: content of {len(frame)} loaded rows")


def info(cfg: DataConfig) -> DatasetInfo:
    """The dataset's shape facts alone (converted from whatever the plugin returns)."""
    r = cfg.plugin
    return as_dataset_info(r.plugin.info(r.options), f"dataset {cfg.dataset!r}")


def load(cfg: DataConfig) -> tuple[pd.DataFrame, DatasetInfo]:
    """Load the configured dataset and its shape facts (converted from whatever the plugin returns)."""
    r = cfg.plugin
    frame = r.plugin.load(r.options)
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"dataset {cfg.dataset!r}: load() returned {type(frame).__name__}, expected a pandas DataFrame")
    return frame.reset_index(drop=True), as_dataset_info(r.plugin.info(r.options), f"dataset {cfg.dataset!r}")


def split(frame: pd.DataFrame, cfg: DataConfig) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Stratified, seeded train/validation/test split (every label in each part in proportion)."""
    rng = np.random.default_rng(cfg.seed)
    rest, test = _stratified(frame["label"].to_numpy(), cfg.test_fraction, rng)
    val_share = cfg.val_fraction / (1.0 - cfg.test_fraction)
    train, val = _stratified(frame["label"].to_numpy()[rest], val_share, rng)
    parts = (rest[train], rest[val], test)
    return tuple(frame.iloc[p].reset_index(drop=True) for p in parts)  # type: ignore[return-value]


def _stratified(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Row positions of (the rest, a held-out `fraction` of the rows), each shuffled.

    The held-out count is ceil(fraction x rows), shared among the labels in proportion to their
    rows, the rows left over going to the labels with the largest remainders. (Written here, not
    scikit-learn's train_test_split: importing scikit-learn costs every run 2-3 s.)
    """
    classes, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    if counts.min() < 2:
        raise ValueError(f"label {classes[counts.argmin()].item()!r} has only 1 row: a stratified split needs at least 2 rows "
                         "of every label; drop the label or add rows")
    n_out = math.ceil(fraction * len(labels))
    share = counts * n_out / len(labels)
    take = np.floor(share).astype(int)
    take[np.argsort(take - share, kind="stable")[: n_out - take.sum()]] += 1
    rest, out = [], []
    for c, k in enumerate(take):
        rows = rng.permutation(np.flatnonzero(inverse == c))
        out.append(rows[:k])
        rest.append(rows[k:])
    return rng.permutation(np.concatenate(rest)), rng.permutation(np.concatenate(out))


def augment(train: pd.DataFrame, info: DatasetInfo, cfg: AugmentConfig) -> pd.DataFrame:
    """Originals plus `cfg.copies` augmented copies of each row; a pure function of (rows, cfg).

    Augmented values are clipped into the dataset's declared `feature_ranges`, so augmented rows
    stay inside the schema the originals passed.
    """
    if cfg.names is None:
        raise ValueError("augment.names is unset: build the config as a PipelineConfig, which fills in the dataset's defaults")
    if cfg.copies == 0 or not cfg.names:
        return train.copy()
    rng = np.random.default_rng(cfg.seed)
    x = train[info.feature_columns].to_numpy(dtype="float32").reshape(-1, *info.input_shape)
    lo, hi = _bounds(info)
    copies = []
    for _ in range(cfg.copies):
        out = x.copy()
        for r in cfg.plugins:
            result = r.plugin(out, rng, r.options)
            if not isinstance(result, np.ndarray) or result.shape != out.shape:
                got = getattr(result, "shape", type(result).__name__)
                raise TypeError(f"augmentation {r.name!r} returned {got} for a batch of shape {out.shape}; "
                                "it must return an array of the same shape")
            out = result.astype("float32", copy=False)
        flat = np.clip(out.reshape(len(out), -1), lo, hi)
        frame = pd.DataFrame(flat, columns=info.feature_columns)
        frame[info.label_column] = train[info.label_column].to_numpy()
        copies.append(frame)
    return pd.concat([train, *copies], ignore_index=True)


def _bounds(info: DatasetInfo) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature (min, max) from the dataset's declared ranges; unbounded where it declares none."""
    ranges = [info.feature_ranges.get(c, (-np.inf, np.inf)) for c in info.feature_columns]
    return np.array([r[0] for r in ranges], dtype="float32"), np.array([r[1] for r in ranges], dtype="float32")


def train_data(train: pd.DataFrame, val: pd.DataFrame, info: DatasetInfo) -> TrainData:
    """The training and validation splits as the tensors strategies train on."""
    return TrainData(*to_tensors(train, info), *to_tensors(val, info))


HEAD_ROWS = 4096  # of a streamed split, held in memory for checks such as the preflight


def train_data_from(train: Shards, val: Shards, info: DatasetInfo) -> TrainData:
    """The splits strategies train on: read whole when they fit, streamed when they do not."""
    columns = [*info.feature_columns, info.label_column]
    train_dir, val_dir = train.dir.download(), val.dir.download()
    if not train.streamed:
        return train_data(shards.read(train_dir, columns), shards.read(val_dir, columns), info)
    stream = Stream(shards.units(train_dir), shards.units(val_dir), info.feature_columns, info.label_column)
    heads = [to_tensors(shards.head(d, HEAD_ROWS, columns), info) for d in (train_dir, val_dir)]
    return TrainData(*heads[0], *heads[1], stream=stream)


def batches(split: Shards, info: DatasetInfo) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A split a row group at a time, as (features, labels) tensors: memory holds one row group."""
    for unit in shards.units(split.dir.download()):
        x, y = read_unit(unit, info.feature_columns, info.label_column)
        yield torch.from_numpy(x), torch.from_numpy(y)


CALIBRATION_ROWS = 512  # of the training split: what a calibrating quantizer sees of the data


def calibration_batches(train: Shards, info: DatasetInfo, batch_size: int = 64) -> list[torch.Tensor]:
    """The first rows of the training split as feature batches, for a quantizer that calibrates
    (a row group at a time: a streamed split is never read whole)."""
    frame = shards.head(train.dir.download(), CALIBRATION_ROWS, [*info.feature_columns, info.label_column])
    x, _ = to_tensors(frame, info)
    return list(torch.split(x, batch_size))


def to_tensors(frame: pd.DataFrame, info: DatasetInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """(features float32 flattened, labels int64)."""
    x = torch.from_numpy(frame[info.feature_columns].to_numpy(dtype="float32"))
    y = torch.from_numpy(frame[info.label_column].to_numpy(dtype="int64"))
    return x, y

