"""The data branch's work on data that fits one process, in one call: what a test, a benchmark or
a notebook prepares a table (or a few batches of examples) with. The pipeline runs the same
steps as separate tasks (tasks/examples.py): the info pinned to the reference and a table given
a field per column (plan), each shard checked and split (a map task), the shards combined."""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd
import pyarrow as pa

from flyscale.config import DataConfig
from flyscale.data import example_combine, example_prep, field_profile, shards, table_examples
from flyscale.data.prepared import Prepared
from flyscale.data.reference import Reference, pin
from flyscale.plugin.records import DatasetInfo


def prepare(
    batches: Iterable[pa.RecordBatch | pa.Table], cfg: DataConfig, info: DatasetInfo, reference: Reference | None = None
) -> Prepared:
    """Pin `info` to the reference, check and split `batches` as one shard, and combine."""
    reference = reference or Reference()
    info = table_examples.fields_of(pin(info, reference, f"dataset {cfg.dataset!r}"))
    edges = field_profile.reference_edges(info, reference.profile)
    part = example_prep.prepare_shard(batches, cfg, info, edges=edges)
    return example_combine.combine([part], cfg, info, reference)


def prepare_table(
    frame: pd.DataFrame, cfg: DataConfig, info: DatasetInfo, reference: Reference | None = None
) -> Prepared:
    """A table in memory, prepared as the pipeline prepares it (its columns held to the reference
    by `prepare` before the batch is read)."""
    return prepare(table_examples.batches([frame], info, f"dataset {cfg.dataset!r}"), cfg, info, reference)


def prepared_frames(prepared: Prepared) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """The train, validation and test splits, each read whole into memory."""
    return tuple(shards.read(s.dir.path) for s in (prepared.train, prepared.val, prepared.test))
