"""Rows as the tensors models take: a DataFrame's features (float32, flattened) and labels
(int64), and a split's shards a row group at a time."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pandas as pd
import torch

from flyscale.data import fields, shards
from flyscale.data.shards import Shards
from flyscale.data.streaming import read_unit
from flyscale.plugin.records import DatasetInfo

log = logging.getLogger(__name__)


def batches(split: Shards, info: DatasetInfo) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A split a row group at a time, as (inputs, labels) tensors: memory holds one row group.
    A shard that holds none of this split's rows yields nothing (not an empty batch)."""
    reader = fields.reader(info)
    for unit in shards.units(split.dir.download()):
        x, y = read_unit(unit, reader)
        if len(x):
            yield torch.from_numpy(x), torch.from_numpy(y)


CALIBRATION_ROWS = 512  # of the training split: what a calibrating quantizer sees of the data


def calibration_batches(train: Shards, info: DatasetInfo, batch_size: int = 64) -> list[torch.Tensor]:
    """The first rows of the training split as feature batches, for a quantizer that calibrates
    (a row group at a time: a streamed split is never read whole)."""
    reader = fields.reader(info)
    x, _ = reader.read(shards.head_table(train.dir.download(), CALIBRATION_ROWS, reader.columns))
    return list(torch.split(torch.from_numpy(x), batch_size))


def to_tensors(frame: pd.DataFrame, info: DatasetInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """(features float32 flattened, labels int64)."""
    x = torch.from_numpy(frame[info.feature_columns].to_numpy(dtype="float32"))
    y = torch.from_numpy(frame[info.label_column].to_numpy(dtype="int64"))
    return x, y
