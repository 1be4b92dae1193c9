"""Built-in text datasets: documents, which flyscale validates (UTF-8, not empty, no duplicates),
splits by document and then tokenizes and packs (the `tokenize` config section).

- `python_docs`: the English that ships with Python itself, `pydoc_data.topics` (about 0.46 MB),
  one document per help topic. Nothing is downloaded.
- `text`: your own documents: text files (a whole file, or its paragraphs or lines, each a
  document), JSONL with a text field, or Parquet with a text column; a file, a directory or an
  `s3://` prefix, one shard per file.

Text comes as the file's bytes wherever it can, so flyscale, not this plugin, decides what does
not decode as UTF-8 (and quarantines it with its file and position).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa

from flyscale.api import SOURCE_FILE, SOURCE_KEY, SOURCE_ROW, DatasetInfo, FieldSpec
from flyscale_plugins import sources

FORMATS = {"txt": "text", "jsonl": "jsonl", "parquet": "parquet"}  # format -> sources.EXTENSIONS key
SPLITTERS = {"file": None, "paragraph": b"\n\n", "line": b"\n"}


def _info(name: str) -> DatasetInfo:
    return DatasetInfo(
        name=name,
        num_classes=0,
        input_shape=[],
        feature_columns=[],
        label_column="",
        fields=[FieldSpec("text", "string", [])],
        input_field="text",
    )


def _batch(texts: list, origin: str, rows: list[int], keys: list[str], kind: pa.DataType) -> pa.RecordBatch:
    return pa.record_batch(
        {
            "text": pa.array(texts, kind),
            SOURCE_FILE: pa.array([origin] * len(texts), pa.string()),
            SOURCE_ROW: pa.array(rows, pa.int64()),
            SOURCE_KEY: pa.array(keys, pa.string()),
        }
    )


class PythonDocs:
    """Python's own help topics (`pydoc_data.topics`), one document per topic, in name order."""

    options_type = None
    default_augmentations = ()

    def info(self, options) -> DatasetInfo:
        return _info("python_docs")

    def fingerprint(self, options) -> str:
        from pydoc_data.topics import topics

        digest = hashlib.sha256(json.dumps(topics, sort_keys=True).encode()).hexdigest()
        return f"pydoc_data.topics of Python {sys.version.split()[0]} sha256:{digest}"

    def examples(self, options, shard: str) -> Iterator[pa.RecordBatch]:
        from pydoc_data.topics import topics

        names = sorted(topics)
        yield _batch([topics[n] for n in names], "pydoc_data.topics", list(range(len(names))), names, pa.string())


@dataclass
class TextOptions:
    path: str = ""  # a file, a directory, or s3://bucket/prefix
    format: str = "auto"  # "txt", "jsonl", "parquet", or "auto": by each file's extension
    field: str = "text"  # the JSONL key, or the Parquet column, holding the document
    document: str = "file"  # txt: "file" (each file one document), "paragraph" (blank-line separated) or "line"
    batch_rows: int = 1024

    def __post_init__(self):
        if not self.path:
            raise ValueError("path must name a file, a directory or an s3:// prefix of documents")
        if self.format not in ("auto", *FORMATS):
            raise ValueError(f"format must be 'auto', 'txt', 'jsonl' or 'parquet', got {self.format!r}")
        if self.document not in SPLITTERS:
            raise ValueError(f"document must be 'file', 'paragraph' or 'line', got {self.document!r}")
        if self.batch_rows < 1:
            raise ValueError(f"batch_rows must be >= 1, got {self.batch_rows}")


def _kind(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    for name, key in FORMATS.items():
        if path.endswith(sources.EXTENSIONS[key]):
            return name
    raise ValueError(f"{path}: not a .txt/.md/.rst, .jsonl or .parquet file; set data.options.format")


class Text:
    """Documents from text, JSONL or Parquet files; each file is a shard."""

    options_type = TextOptions
    default_augmentations = ()

    def info(self, options: TextOptions) -> DatasetInfo:
        return _info("text")

    def _files(self, options: TextOptions, versions: bool = False) -> list[sources.Source]:
        formats = list(FORMATS) if options.format == "auto" else [options.format]
        found: dict[str, sources.Source] = {}
        for fmt in formats:
            try:
                found.update({s.uri: s for s in sources.listing(options.path, FORMATS[fmt], versions=versions)})
            except ValueError as exc:
                if "holds no" not in str(exc):
                    raise
        if not found:
            raise ValueError(
                f"data.options.path {options.path!r} holds no documents (.txt, .md, .rst, .jsonl, .parquet)"
            )
        return [found[k] for k in sorted(found)]

    def fingerprint(self, options: TextOptions) -> str:
        listing = [(s.uri, s.version) for s in self._files(options, versions=True)]
        return "text " + hashlib.sha256(json.dumps([listing, options.field, options.document]).encode()).hexdigest()

    def shards(self, options: TextOptions) -> list[str]:
        return [s.uri for s in self._files(options)]

    def examples(self, options: TextOptions, shard: str) -> Iterator[pa.RecordBatch]:
        source = next(s for s in self._files(options) if s.uri == shard)
        kind = _kind(source.uri, options.format)
        if kind == "parquet":
            yield from self._parquet(source, options)
            return
        data = sources.read_bytes(source)
        docs, keys = _jsonl(data, options.field) if kind == "jsonl" else _txt(data, options.document)
        step = options.batch_rows
        for i in range(0, len(docs), step):
            rows = list(range(i, min(i + step, len(docs))))
            texts = docs[i : i + step]
            yield _batch(texts, source.uri, rows, keys[i : i + step], pa.binary() if kind == "txt" else pa.string())

    def _parquet(self, source: sources.Source, options: TextOptions) -> Iterator[pa.RecordBatch]:
        names = sources.schema(source, "parquet").names
        if options.field not in names:
            raise ValueError(f"{source.uri} has no column {options.field!r} (data.options.field); it has {names}")
        first = 0
        for batch in sources.batches(source, "parquet", [options.field], options.batch_rows):
            n = batch.num_rows
            rows = list(range(first, first + n))
            yield _batch(batch.column(0).to_pylist(), source.uri, rows, [str(r) for r in rows], pa.string())
            first += n


def _txt(data: bytes, document: str) -> tuple[list[bytes], list[str]]:
    """A text file's documents, as bytes (flyscale checks they decode), and where each starts."""
    splitter = SPLITTERS[document]
    if splitter is None:
        return [data], ["whole file"]
    docs, keys, line = [], [], 1
    for part in data.split(splitter):
        if part.strip():  # blank paragraphs and lines are separators, not documents
            docs.append(part)
            keys.append(f"line {line}")
        line += part.count(b"\n") + splitter.count(b"\n")
    return docs, keys


def _jsonl(data: bytes, key: str) -> tuple[list[str | None], list[str]]:
    """A JSONL file's documents; a line that is not JSON, or has no string `key`, as None (which
    flyscale quarantines as missing, with its line)."""
    docs: list[str | None] = []
    keys = []
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line).get(key)
        except (ValueError, AttributeError):
            value = None
        docs.append(value if isinstance(value, str) else None)
        keys.append(f"line {number}")
    return docs, keys


python_docs = PythonDocs()
text = Text()
