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
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa

from flyscale.api import SOURCE_FILE, SOURCE_KEY, SOURCE_ROW, DatasetInfo, FieldSpec
from flyscale_plugins import sources

FORMATS = {"txt": "text", "jsonl": "jsonl", "parquet": "parquet"}  # format -> sources.EXTENSIONS key
DOCUMENTS = ("file", "paragraph", "line")  # what one document of a text file is
BLANK_LINES = re.compile(rb"\r?\n(?:[ \t]*\r?\n)+")  # the end of a line, then one or more blank lines


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


def _batch(texts: pa.Array, origin: str, first: int, keys: list[str]) -> pa.RecordBatch:
    """Documents `first`, `first + 1`, ... of the file `origin`, with their origin columns."""
    return pa.record_batch(
        {
            "text": texts,
            SOURCE_FILE: pa.array([origin] * len(texts), pa.string()),
            SOURCE_ROW: pa.array(range(first, first + len(texts)), pa.int64()),
            SOURCE_KEY: pa.array(keys, pa.string()),
        }
    )


class PythonDocs:
    """Python's own help topics (`pydoc_data.topics`), one document per topic, in name order."""

    options_type = None
    default_augmentations = ()
    objective = "language_modeling"  # documents without labels: what they are for (its default model name)

    def info(self, options) -> DatasetInfo:
        return _info("python_docs")

    def fingerprint(self, options) -> str:
        from pydoc_data.topics import topics

        digest = hashlib.sha256(json.dumps(topics, sort_keys=True).encode()).hexdigest()
        return f"pydoc_data.topics of Python {sys.version.split()[0]} sha256:{digest}"

    def examples(self, options, shard: str) -> Iterator[pa.RecordBatch]:
        from pydoc_data.topics import topics

        names = sorted(topics)
        yield _batch(pa.array([topics[n] for n in names], pa.string()), "pydoc_data.topics", 0, names)


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
        if self.document not in DOCUMENTS:
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
    objective = "language_modeling"  # documents without labels: what they are for (its default model name)

    def info(self, options: TextOptions) -> DatasetInfo:
        return _info("text")

    def _files(self, options: TextOptions, versions: bool = False) -> list[sources.Source]:
        formats = list(FORMATS) if options.format == "auto" else [options.format]
        found: dict[str, sources.Source] = {}
        for fmt in formats:
            try:
                found.update({s.uri: s for s in sources.listing(options.path, FORMATS[fmt], versions=versions)})
            except ValueError as exc:
                if "holds no" not in str(exc):  # a missing path or bucket, denied access: the user must hear it
                    raise
        if not found:
            raise ValueError(
                f"data.options.path {options.path!r} holds no documents (.txt, .md, .rst, .jsonl, .parquet)"
            )
        return [found[k] for k in sorted(found)]

    def fingerprint(self, options: TextOptions) -> str:
        """Each file's version (`sources.listing`) and how its documents are read."""
        listing = [(s.uri, s.version) for s in self._files(options, versions=True)]
        return "text " + hashlib.sha256(json.dumps([listing, options.field, options.document]).encode()).hexdigest()

    def shards(self, options: TextOptions) -> list[str]:
        """The files, in sorted order."""
        return [s.uri for s in self._files(options)]

    def examples(self, options: TextOptions, shard: str) -> Iterator[pa.RecordBatch]:
        """One file's documents, `batch_rows` at a time."""
        # Built from the shard's name, not found by listing again: one listing per shard of a
        # large S3 prefix would make the map task quadratic.
        source = sources.Source(shard, shard.removeprefix("s3://") if sources.is_s3(shard) else shard, "")
        kind = _kind(source.uri, options.format)
        if kind == "parquet":
            yield from _parquet(source, options)
            return
        data = sources.read_bytes(source)
        docs, keys = _jsonl(data, options.field) if kind == "jsonl" else _txt(data, options.document)
        step = options.batch_rows
        for i in range(0, len(docs), step):
            yield _batch(pa.array(docs[i : i + step], pa.binary()), source.uri, i, keys[i : i + step])


def _parquet(source: sources.Source, options: TextOptions) -> Iterator[pa.RecordBatch]:
    """A Parquet file's text column, as strings (or as bytes, which flyscale checks decode)."""
    schema = sources.schema(source, "parquet")
    if options.field not in schema.names:
        raise ValueError(f"{source.uri} has no column {options.field!r} (data.options.field); it has {schema.names}")
    kind = schema.field(options.field).type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        target = pa.string()
    elif pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        target = pa.binary()
    else:
        raise ValueError(f"{source.uri}: column {options.field!r} holds {kind}, not text (a string or binary column)")
    first = 0
    for batch in sources.batches(source, "parquet", [options.field], options.batch_rows):
        n = batch.num_rows
        keys = [f"row {r}" for r in range(first, first + n)]
        yield _batch(batch.column(0).cast(target), source.uri, first, keys)
        first += n


def _txt(data: bytes, document: str) -> tuple[list[bytes], list[str]]:
    """A text file's documents, as bytes (flyscale checks they decode), and the line each starts on.
    Blank lines and paragraphs separate documents; they are none themselves."""
    if document == "file":
        return [data], ["whole file"]
    if document == "line":
        lines = data.split(b"\n")
        kept = [i for i, line in enumerate(lines) if line.strip()]
        return [lines[i].removesuffix(b"\r") for i in kept], [f"line {i + 1}" for i in kept]
    docs, keys, start, line = [], [], 0, 1
    for gap in [*BLANK_LINES.finditer(data), None]:
        end = len(data) if gap is None else gap.start()
        # A lone line ending at either end of the file (no blank line) is no part of a paragraph.
        body = data[start:end]
        part = body.strip(b"\r\n")
        if part.strip():
            first = line + body.count(b"\n", 0, len(body) - len(body.lstrip(b"\r\n")))
            docs.append(part)
            keys.append(f"line {first}")
        if gap is not None:
            line += data.count(b"\n", start, gap.end())
            start = gap.end()
    return docs, keys


def _jsonl(data: bytes, key: str) -> tuple[list[bytes | None], list[str]]:
    """A JSONL file's documents and their lines; a line that is not JSON, or has no string `key`,
    comes as None (which flyscale quarantines as missing, with its line). Blank lines are skipped."""
    docs: list[bytes | None] = []
    keys = []
    for number, line in enumerate(data.split(b"\n"), start=1):
        if line.strip():
            docs.append(_field(line, key))
            keys.append(f"line {number}")
    return docs, keys


def _field(line: bytes, key: str) -> bytes | None:
    try:
        value = json.loads(line)
    except ValueError:  # not JSON, or not in a Unicode encoding
        return None
    value = value.get(key) if isinstance(value, dict) else None
    if not isinstance(value, str):
        return None
    # As UTF-8 bytes, which flyscale checks: a lone surrogate (a legal JSON escape, "\ud800") then
    # fails that check with its line, where pyarrow would refuse the whole batch as a string.
    return value.encode("utf-8", errors="surrogatepass")


python_docs = PythonDocs()
text = Text()
