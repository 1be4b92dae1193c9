"""`python_docs`: the English that ships with Python itself, `pydoc_data.topics` (about 0.46 MB),
one document per help topic, as the `text` dataset gives documents (plugins/text.py). Nothing is
downloaded: the corpus a language model preset (configs/text-gpt.yaml) trains on anywhere."""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator

import pyarrow as pa

from flyscale.api import DatasetInfo
from flyscale_plugins.text import documents_batch, documents_info


class PythonDocs:
    """Python's own help topics (`pydoc_data.topics`), one document per topic, in name order."""

    options_type = None
    default_augmentations = ()
    objective = "language_modeling"  # documents without labels: what they are for (its default model name)

    def info(self, options) -> DatasetInfo:
        return documents_info("python_docs")

    def fingerprint(self, options) -> str:
        from pydoc_data.topics import topics

        digest = hashlib.sha256(json.dumps(topics, sort_keys=True).encode()).hexdigest()
        return f"pydoc_data.topics of Python {sys.version.split()[0]} sha256:{digest}"

    def examples(self, options, shard: str) -> Iterator[pa.RecordBatch]:
        from pydoc_data.topics import topics

        names = sorted(topics)
        yield documents_batch(pa.array([topics[n] for n in names], pa.string()), "pydoc_data.topics", 0, names)


python_docs = PythonDocs()
