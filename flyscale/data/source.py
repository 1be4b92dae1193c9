"""What a dataset plugin gives: its rows and shape facts, loaded and converted at the boundary,
and the identity of its data (its fingerprint), which the loading stage is keyed on."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import pandas as pd
import pyarrow as pa

from flyscale.config import DataConfig
from flyscale.data import table_examples
from flyscale.errors import DataError, data_errors
from flyscale.plugin.data_kind import DataKind, declared_kind
from flyscale.plugin.records import DatasetInfo, as_dataset_info

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
    own = r.method("fingerprint")
    if own is not None:
        with data_errors(f"dataset {cfg.dataset!r}"):
            identity = own(r.options)
        if not isinstance(identity, str) or not identity:
            raise TypeError(f"dataset {cfg.dataset!r}: fingerprint() returned {identity!r}; expected a non-empty str")
        value, method = hashlib.sha256(identity.encode()).hexdigest(), f"dataset {cfg.dataset!r}: its fingerprint()"
    else:
        frame, _ = load(cfg)
        value, method = frame_hash(frame), f"dataset {cfg.dataset!r}: content of {len(frame)} rows (no fingerprint())"
    return DataFingerprint(dataset=cfg.dataset, value=value, method=method)


def content_fingerprint(frame: pd.DataFrame, cfg: DataConfig) -> DataFingerprint:
    """The fingerprint of what was loaded: the same bytes give the same one, however they got there."""
    return DataFingerprint(
        cfg.dataset, frame_hash(frame), f"dataset {cfg.dataset!r}: content of {len(frame)} loaded rows"
    )


def info(cfg: DataConfig) -> DatasetInfo:
    """The dataset's shape facts alone (converted from whatever the plugin returns)."""
    r = cfg.plugin
    with data_errors(f"dataset {cfg.dataset!r}"):
        found = r.plugin.info(r.options)
    return as_dataset_info(found, f"dataset {cfg.dataset!r}")


def kind(cfg: DataConfig) -> DataKind:
    """What the dataset gives, decided once a run (fingerprint_data returns it): what its plugin
    declares, and typed examples whose input is a string field are documents."""
    declared = declared_kind(cfg.plugin)
    if declared is not DataKind.EXAMPLES:
        return declared
    field = info(cfg).input()
    return DataKind.DOCUMENTS if field is not None and field.dtype == "string" else declared


def shards(cfg: DataConfig) -> list[str]:
    """The pieces a dataset of typed examples comes in, in its order ([""]: one piece)."""
    r = cfg.plugin
    listed = r.method("shards")
    if listed is None:
        return [""]
    with data_errors(f"dataset {cfg.dataset!r}"):
        names = [str(s) for s in listed(r.options)]
    if not names:
        raise DataError(f"dataset {cfg.dataset!r} has no shards: there is nothing to validate or train on")
    if len(set(names)) != len(names):
        raise DataError(f"dataset {cfg.dataset!r}: shards() named a shard twice; each must be named once")
    return names


def examples(cfg: DataConfig, shard: str) -> Iterator[pa.RecordBatch | pa.Table]:
    """One shard's typed examples, as the dataset's plugin hands them over; a table's rows (one
    shard) as typed examples of a field per column (flyscale/data/table_examples.py)."""
    r = cfg.plugin
    where = f"dataset {cfg.dataset!r}" + (f", shard {shard!r}" if shard else "")
    declared = declared_kind(r)
    if declared is DataKind.TABLE_STREAM:
        yield from table_examples.batches(chunks(cfg), info(cfg), where)
        return
    if declared is DataKind.TABLE:
        frame, table_info = load(cfg)
        yield from table_examples.batches([frame], table_info, where)
        return
    with data_errors(where):
        yield from r.plugin.examples(r.options, shard)


def load(cfg: DataConfig) -> tuple[pd.DataFrame, DatasetInfo]:
    """Load the configured dataset and its shape facts (converted from whatever the plugin returns)."""
    r = cfg.plugin
    if not declared_kind(r).is_table:
        raise DataError(
            f"dataset {cfg.dataset!r} gives typed examples (images, ...), not a table; this stage "
            "(the scaling study, or a table-only tool) reads tables only: use training_pipeline"
        )
    with data_errors(f"dataset {cfg.dataset!r}"):
        frame = r.plugin.load(r.options)
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"dataset {cfg.dataset!r}: load() returned {type(frame).__name__}, expected a pandas DataFrame")
    return frame.reset_index(drop=True), info(cfg)


def chunks(cfg: DataConfig) -> Iterator[pd.DataFrame]:
    """A streaming dataset's chunks, as its plugin reads them."""
    r = cfg.plugin
    with data_errors(f"dataset {cfg.dataset!r}"):
        yield from r.plugin.chunks(r.options)
