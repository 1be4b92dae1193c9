"""The Protocols of the plugins that give the data: a dataset, and an augmentation of its batches."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from flyscale.plugin.records import DatasetInfo

if TYPE_CHECKING:  # for the annotations only: configs and the plugin registry load without pandas
    import pandas as pd


class DatasetPlugin(Protocol):
    """A source of labelled rows: one `label` column plus numeric feature columns.

    Optional: `row_schema(options)`, a pandera DataFrameSchema whose row-level failures send
    rows to quarantine (without one, flyscale checks what `info` declares: finite features
    inside `feature_ranges`, labels in [0, num_classes), no other columns); `options_type` (a
    dataclass of the plugin's options, or None); `default_augmentations` (augmentation names
    that fit this data, used when the config leaves `augment.names` unset; none if absent);
    `fingerprint(options) -> str`, a cheap identity of the data as it is now (the built-in
    file datasets use each file's size and modification time, so a rewrite that keeps both is not
    seen): every run takes it, and loading re-runs only when it changes. Without one, every run loads the data to hash its content.
    `streaming = True` with `chunks(options)`, an iterator of frames like `load`'s: the data is
    larger than memory, so flyscale validates it chunk by chunk and training streams it.
    `objective` (default "classification"): the objective the data is for; a run with another
    one is registered under a name of its own (flyscale.config.publishing.default_model_name).

    A dataset of typed examples (images, text, ...) declares its `fields` in `info` and has
    `examples(options, shard)` instead of `load`: an iterator of `pyarrow.RecordBatch`es of one
    shard, one column per field (a fixed-size list or a list of numbers, binary for encoded
    images, string or binary for text, or a scalar), and the origin columns `_source_file` and
    `_source_row` (the file or object, and the example's position in it). Optional
    `shards(options)`: the names of the pieces the data comes in (files, objects, tar shards), in
    a stable order; flyscale prepares them as a Flyte map task, a pod each on a cluster, and
    combines what they found. A dataset without `shards` is one piece, and `shard` is "".

    Optional `parts(options)` and `part(options, name)`: the pieces (files) a dataset of rows
    comes in, and every column of one piece as frames with the origin columns (no label needed).
    `batch_predict` scores a dataset a piece at a time, a Flyte map task each.
    flyscale validates each field, quarantines bad examples with their origin and reason,
    de-duplicates across shards and splits by origin, however large the data.
    """

    def load(self, options: Any) -> pd.DataFrame: ...

    def info(self, options: Any) -> DatasetInfo: ...


class AugmentationPlugin(Protocol):
    """Transforms a batch of examples, shape (N, *input_shape), deterministically given `rng`.

    The result keeps the batch's shape. flyscale clips it into the dataset's `feature_ranges`.
    """

    def __call__(self, x: np.ndarray, rng: np.random.Generator, options: Any) -> np.ndarray: ...
