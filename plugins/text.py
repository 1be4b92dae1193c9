"""Built-in text datasets: documents, which flyscale validates (UTF-8, not empty, no duplicates),
splits by document and then tokenizes and packs (the `tokenize` config section).

- `python_docs` (plugins/python_docs.py): the English that ships with Python itself, one document
  per help topic.
- `text`: your own documents: text files (a whole file, or its paragraphs or lines, each a
  document), JSONL with a text field, or Parquet with a text column; a file, a directory or an
  `s3://` prefix, one shard per file, and a file larger than `shard_bytes` cut into byte ranges
  of that size, each a shard of its own (plugins/text_files.py). With `classes`, and `label` (a
  JSONL key or a Parquet column) or `label_from_folder` (`root/<class>/*.txt`), each document has
  a class: a labelled dataset, which flyscale tokenizes one row per document for a classifier
  instead of packing it for a language model.

Text comes as the file's bytes wherever it can, so flyscale, not this plugin, decides what does
not decode as UTF-8 (and quarantines it with its file and position). Files are read a line at a
time: a document (a line, a paragraph, a JSONL record, a whole file) larger than
`max_document_bytes` is never held in memory, and comes with its reason instead, as does a JSONL
line that is not JSON or holds no text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import pyarrow as pa

from flyscale.api import SOURCE_FILE, SOURCE_KEY, SOURCE_PROBLEM, SOURCE_ROW, DatasetInfo, FieldSpec
from flyscale_plugins import sources, text_files

FORMATS = {"txt": "text", "jsonl": "jsonl", "parquet": "parquet"}  # format -> sources.EXTENSIONS key
DOCUMENTS = ("file", "paragraph", "line")  # what one document of a text file is
MAX_DOCUMENT_BYTES = 16 << 20  # a longer document (a 50 MB JSONL line) is quarantined unread
SHARD_BYTES = 256 << 20  # a larger text or JSONL file is read by several shards
BATCH_BYTES = 64 << 20  # documents handed over at a time, at most (and batch_rows of them)
RANGE = re.compile(r"^(?P<uri>.+)#bytes=(?P<start>\d+)-(?P<end>\d+)$")  # a shard that is part of a file


LABEL = "label"  # the column a labelled dataset's class index travels in, whatever the file calls it


def documents_info(name: str, classes: list[str] | None = None, root: str = "") -> DatasetInfo:
    """Documents (their files under `root`); with `classes`, each with its class's index as the label."""
    labelled = [FieldSpec(LABEL, "int64", [], range=[0, len(classes) - 1])] if classes else []
    return DatasetInfo(
        name=name,
        num_classes=len(classes or []),
        input_shape=[],
        feature_columns=[],
        label_column=LABEL if classes else "",
        fields=[FieldSpec("text", "string", []), *labelled],
        input_field="text",
        root=root,
    )


def documents_batch(
    texts: pa.Array,
    origin: str,
    first: int,
    keys: list[str],
    problems: list | None = None,
    labels: list[int | None] | None = None,
) -> pa.RecordBatch:
    """Documents `first`, `first + 1`, ... of the file `origin`, with their origin columns (and
    their classes, for a labelled dataset)."""
    columns = {"text": texts} | ({LABEL: pa.array(labels, pa.int64())} if labels is not None else {})
    return pa.record_batch(
        columns
        | {
            SOURCE_FILE: pa.array([origin] * len(texts), pa.string()),
            SOURCE_ROW: pa.array(range(first, first + len(texts)), pa.int64()),
            SOURCE_KEY: pa.array(keys, pa.string()),
            SOURCE_PROBLEM: pa.array(problems or [None] * len(texts), pa.string()),
        }
    )


@dataclass
class TextOptions:
    path: str = ""  # a file, a directory, or s3://bucket/prefix
    format: str = "auto"  # "txt", "jsonl", "parquet", or "auto": by each file's extension
    field: str = "text"  # the JSONL key, or the Parquet column, holding the document
    document: str = "file"  # txt: "file" (each file one document), "paragraph" (blank-line separated) or "line"
    batch_rows: int = 1024
    max_document_bytes: int = MAX_DOCUMENT_BYTES  # a longer document is quarantined, never read into memory
    shard_bytes: int = SHARD_BYTES  # a larger .txt or .jsonl file is cut into ranges of this size, one shard each
    # A labelled dataset: the JSONL key, or the Parquet column, holding each document's class, and
    # the classes in label order (a value is matched as text: 1 and "1" are the same class). A
    # document whose class is missing or not listed is quarantined, naming it. "": documents alone.
    label: str = ""
    classes: list[str] = dataclasses.field(default_factory=list)
    # Or each file's documents have the class its folder is named after (root/<class>/*.txt, the
    # layout of many labelled corpora), for any format.
    label_from_folder: bool = False

    @property
    def labelled(self) -> bool:
        return bool(self.label) or self.label_from_folder

    def __post_init__(self):
        if self.label and self.label_from_folder:
            raise ValueError(
                f"data.options.label ({self.label!r}) and data.options.label_from_folder both say where the class is: "
                "set one"
            )
        if self.labelled != bool(self.classes):
            raise ValueError(
                "data.options.classes goes with data.options.label or label_from_folder: label names the JSONL key or "
                "Parquet column holding each document's class (label_from_folder: the folder holding its file), "
                f"classes lists them in label order (got label={self.label!r}, "
                f"label_from_folder={self.label_from_folder}, classes={self.classes!r})"
            )
        if self.classes:
            self.classes = [str(c) for c in self.classes]
            if len(self.classes) < 2 or len(set(self.classes)) != len(self.classes):
                raise ValueError(f"data.options.classes must list at least 2 distinct classes, got {self.classes}")
            if self.label == self.field:
                raise ValueError(f"data.options.label and data.options.field both name {self.field!r}")
        if not self.path:
            raise ValueError("path must name a file, a directory or an s3:// prefix of documents")
        for name in ("max_document_bytes", "shard_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
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
        return documents_info("text", options.classes, sources.listed_root(options.path))

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
        """Each file's version (`sources.listing`) and how its documents (and classes) are read."""
        listing = [(s.uri, s.version) for s in self._files(options, versions=True)]
        labelled = [options.label, options.label_from_folder, options.classes] if options.labelled else []
        how = [listing, options.field, options.document, *labelled]
        return "text " + hashlib.sha256(json.dumps(how).encode()).hexdigest()

    def shards(self, options: TextOptions) -> list[str]:
        """The files, in sorted order; a text or JSONL file larger than `shard_bytes` as its byte
        ranges (`FILE#bytes=START-END`), unless each document is a whole file."""
        out = []
        for s in self._files(options):
            kind = _kind(s.uri, options.format)
            whole = kind == "parquet" or (kind == "txt" and options.document == "file")
            if whole or s.size <= options.shard_bytes:
                out.append(s.uri)
            else:
                step = options.shard_bytes
                out += [f"{s.uri}#bytes={a}-{min(a + step, s.size)}" for a in range(0, s.size, step)]
        return out

    def examples(self, options: TextOptions, shard: str) -> Iterator[pa.RecordBatch]:
        """One shard's documents, `batch_rows` (and at most BATCH_BYTES) at a time."""
        batches = self._read(options, shard)
        if options.label_from_folder:
            ranged = RANGE.match(shard)
            batches = _folder_class(batches, ranged["uri"] if ranged else shard, options)
        yield from batches

    def _read(self, options: TextOptions, shard: str) -> Iterator[pa.RecordBatch]:
        ranged = RANGE.match(shard)
        uri = ranged["uri"] if ranged else shard
        start, end = (int(ranged["start"]), int(ranged["end"])) if ranged else (0, None)
        # Built from the shard's name, not found by listing again: one listing per shard of a
        # large S3 prefix would make the map task quadratic.
        source = sources.Source(uri, uri.removeprefix("s3://") if sources.is_s3(uri) else uri, "")
        kind = _kind(source.uri, options.format)
        if kind == "parquet":
            yield from _parquet(source, options)
            return
        if kind == "txt" and options.label:
            raise ValueError(
                f"{source.uri}: a text file holds no classes; a labelled dataset (data.options.label) is JSONL or "
                f"Parquet, each document beside its class; or set data.options.label_from_folder for text files in "
                f"a folder per class"
            )
        docs, keys, problems, labels, held, first = [], [], [], [], 0, 0
        with sources.open_file(source) as f:
            for doc, key, problem, label in _documents(f, kind, options, start, end):
                docs.append(doc)
                keys.append(key)
                problems.append(problem)
                labels.append(label)
                held += len(doc or b"")
                if len(docs) == options.batch_rows or held >= BATCH_BYTES:
                    yield self._as_batch(options, docs, shard, first, keys, problems, labels)
                    first += len(docs)
                    docs, keys, problems, labels, held = [], [], [], [], 0
        if docs:
            yield self._as_batch(options, docs, shard, first, keys, problems, labels)

    @staticmethod
    def _as_batch(options: TextOptions, docs, shard, first, keys, problems, labels) -> pa.RecordBatch:
        return documents_batch(
            pa.array(docs, pa.binary()), shard, first, keys, problems, labels if options.label else None
        )


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
    if options.label and options.label not in schema.names:
        raise ValueError(f"{source.uri} has no column {options.label!r} (data.options.label); it has {schema.names}")
    first = 0
    columns = [options.field, options.label] if options.label else [options.field]
    for batch in sources.batches(source, "parquet", columns, options.batch_rows):
        n = batch.num_rows
        keys = [f"row {r}" for r in range(first, first + n)]
        if not options.label:
            yield documents_batch(batch.column(0).cast(target), source.uri, first, keys)
        else:
            found = [_class_of(v, options) for v in batch.column(1).to_pylist()]
            labels, problems = [c for c, _ in found], [p for _, p in found]
            yield documents_batch(batch.column(0).cast(target), source.uri, first, keys, problems, labels)
        first += n


def _folder_class(batches: Iterator[pa.RecordBatch], uri: str, options: TextOptions) -> Iterator[pa.RecordBatch]:
    """The batches of the file `uri` with the class its folder is named after, for every document
    (or, for a folder that is not a class, that reason for each one without a reason already)."""
    folder = posixpath.basename(posixpath.dirname(uri))
    label, problem = _class_of(folder, options)
    if problem:
        problem = f"{LABEL}: class (got the folder {folder!r}, not one of data.options.classes {options.classes})"
    for batch in batches:
        columns = {name: batch.column(name) for name in batch.schema.names if name != LABEL}
        columns[LABEL] = pa.array([label] * batch.num_rows, pa.int64())
        said = batch.column(SOURCE_PROBLEM).to_pylist()
        columns[SOURCE_PROBLEM] = pa.array([p or problem for p in said], pa.string())
        yield pa.record_batch(columns)


def _class_of(value: object, options: TextOptions) -> tuple[int | None, str | None]:
    """A document's class index, or None and why (missing, or not one of `classes`)."""
    if value is None or isinstance(value, (bool, dict, list)) or not isinstance(value, (str, int, float)):
        got = "null" if value is None else f"a {type(value).__name__}"
        return None, f"{LABEL}: missing (got {got} under {options.label!r}, data.options.label)"
    name = str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
    if name not in options.classes:
        shown = name if len(name) <= 40 else name[:40] + "..."
        return None, f"{LABEL}: class (got {shown!r}, not one of data.options.classes {options.classes})"
    return options.classes.index(name), None


def _documents(
    f: BinaryIO, kind: str, options: TextOptions, start: int, end: int | None
) -> Iterator[tuple[bytes | None, str, str | None, int | None]]:
    """(document as bytes or None, where it starts, why it is None, its class) for each document
    of the range; a JSONL document without a class listed has the reason, and the text as read."""
    cap = options.max_document_bytes
    if kind == "txt" and options.document == "file":
        data = f.read(cap + 1)
        if len(data) > cap:
            yield None, "whole file", _too_long("a file", f.seek(0, 2), cap), None
        else:  # a blank one too, which flyscale quarantines as empty
            yield data.removeprefix(text_files.BOM), "whole file", None, None
        return
    pieces = text_files.paragraphs if kind == "txt" and options.document == "paragraph" else text_files.lines
    for p in pieces(f, start, end, cap):
        where = f"line {p.line}" if end is None else f"byte {p.offset}"  # a range's lines are not counted
        if p.data is None:
            yield None, where, _too_long("a line" if pieces is text_files.lines else "a paragraph", p.size, cap), None
        elif not p.data.strip():
            continue  # a blank line separates documents; it is none itself
        elif kind == "jsonl":
            yield _jsonl_document(p.data, options, where)
        elif options.document == "line":
            yield p.data.removesuffix(b"\r"), where, None, None
        else:
            yield p.data, where, None, None


def _too_long(what: str, size: int, cap: int) -> str:
    return f"text: size (got {what} of {size} bytes, over data.options.max_document_bytes {cap}: not read)"


def _jsonl_document(line: bytes, options: TextOptions, where: str) -> tuple[bytes | None, str, str | None, int | None]:
    """A JSONL line's document and class, or None and why: the line is not JSON, holds no string
    under `field`, or (labelled) no listed class under `label`."""
    try:
        record = json.loads(line)
    except UnicodeDecodeError as exc:  # as flyscale says of a document that is not UTF-8
        return None, where, f"text: utf8 (got byte {exc.start} is not UTF-8)", None
    except ValueError as exc:
        return None, where, f"text: json (got a line that is not JSON: {str(exc).split(':')[0]})", None
    record = record if isinstance(record, dict) else {}
    value = record.get(options.field)
    if not isinstance(value, str):
        return None, where, f"text: missing (got no string under {options.field!r}, data.options.field)", None
    # As UTF-8 bytes, which flyscale checks: a lone surrogate (a legal JSON escape, "\ud800") then
    # fails that check with its line, where pyarrow would refuse the whole batch as a string.
    document = value.encode("utf-8", errors="surrogatepass")
    if not options.label:
        return document, where, None, None
    label, problem = _class_of(record.get(options.label), options)
    return document, where, problem, label


text = Text()
