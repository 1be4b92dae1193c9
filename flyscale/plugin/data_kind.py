"""What a dataset gives, decided once: the one place that reads it from the dataset plugin's
methods. Everything after (config checks, the workflow's data branch, batch prediction) reads
the `DataKind` instead of asking the plugin what it has.

The methods are the contract (flyscale/plugin/data_protocols.py): `examples()` gives typed examples,
`streaming = True` with `chunks()` a table too large for memory, and `load()` a table. Whether
typed examples are documents (their input a string field, tokenized and packed) needs the
dataset's info, so `flyscale.data.source.kind` refines EXAMPLES into DOCUMENTS.
"""

from __future__ import annotations

import enum

from flyscale.plugin.registry import Resolved


class DataKind(enum.Enum):
    TABLE = "table"  # load(): one DataFrame, validated and split in memory
    TABLE_STREAM = "table_stream"  # chunks(): a table read and split chunk by chunk
    EXAMPLES = "examples"  # examples(): Arrow batches of declared fields (images, ...), shard by shard
    DOCUMENTS = "documents"  # examples whose input is a string field: tokenized and packed

    @property
    def is_table(self) -> bool:
        return self in (DataKind.TABLE, DataKind.TABLE_STREAM)


def declared_kind(dataset: Resolved) -> DataKind:
    """The kind a dataset plugin's methods declare (EXAMPLES for documents too: see the module's docstring)."""
    if dataset.method("examples") is not None:
        return DataKind.EXAMPLES
    return DataKind.TABLE_STREAM if dataset.attribute("streaming") else DataKind.TABLE
