"""The `parquet` and `csv` datasets: labelled rows from files on local disk or in S3.

`path` is a single file, a directory (every file of the format beneath it), or
`s3://bucket/prefix` (every such object under the prefix); files are read in sorted order, so
the same files give the same frame from disk or from S3 (plugins/sources.py).

What a run may assume about the data is declared in the options (features, ranges, classes) or
inferred from the files, and either way checked:

- file by file, before any row is trusted: a missing column, an extra one, a column of text
  where numbers belong, an unreadable or truncated file. Each rejects the data with an error
  naming the file and the column;
- row by row, by the schema flyscale builds from the info (`default_row_schema`): NaN, inf,
  values outside their range and labels outside the classes send rows to quarantine.

Inferred features are the numeric columns of the first file other than the label and the
`ignore`d ones; a text column is never dropped silently (it must be ignored by name). Inferred
classes are the labels 0..K-1 that appear without a gap: one stray label of 999 does not make
a 1000-way classifier, its rows are quarantined. Whatever was inferred is reported in the
info (`inferred`), so flyscale can pin it and hold later batches to it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow

from flyscale.api import SOURCE_FILE, SOURCE_ROW, DatasetInfo
from flyscale_plugins import sources

LABEL = "label"  # the column name every later stage relies on


@dataclass
class TabularOptions:
    path: str = ""  # required; a default only so a missing path gets the clear message below
    format: str = ""  # "parquet" or "csv"; empty: the dataset's own (parquet for `parquet`, csv for `csv`)
    label: str = "label"  # source column holding the class; renamed to `label` on load
    features: list[str] = field(default_factory=list)  # empty: inferred (see the module docstring)
    ignore: list[str] = field(default_factory=list)  # columns in the files that are neither features nor label
    num_classes: int = 0  # 0: inferred
    input_shape: list[int] = field(default_factory=list)  # empty: [number of features]
    ranges: dict = field(default_factory=dict)  # {column: [min, max]}, checked per row
    # The data's version: each file's size, mtime, ctime and inode (an S3 object's size and ETag);
    # true: the sha256 of every file's bytes, read in full on every run (sources.listing).
    content_hash: bool = False

    def __post_init__(self):
        if not str(self.path).strip():
            raise ValueError(
                "data.options.path is required: a file, a directory of files, or an s3://bucket/prefix URI"
            )
        if self.format not in ("", *sources.EXTENSIONS):
            raise ValueError(f"data.options.format must be one of {', '.join(sources.EXTENSIONS)}, got {self.format!r}")
        if sources.is_s3(self.path) and not self.path[len("s3://") :].split("/")[0]:
            raise ValueError(f"data.options.path {self.path!r} names no bucket; expected s3://bucket/prefix")
        if not self.label.strip():
            raise ValueError("data.options.label must name the label column")
        for name in ("features", "ignore"):
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"data.options.{name} lists a column twice: {values}")
        if self.label in self.features or LABEL in self.features:
            # The label is renamed to `label` on load; a feature of either name would collide.
            raise ValueError(f"data.options.features must not include {self.label!r} or {LABEL!r}")
        if set(self.ignore) & (set(self.features) | {self.label}):
            raise ValueError(f"data.options.ignore names a feature or the label: {self.ignore}")
        if self.num_classes < 0:
            raise ValueError(f"data.options.num_classes must be >= 0 (0 = infer), got {self.num_classes}")
        if any(int(d) <= 0 for d in self.input_shape):
            raise ValueError(f"data.options.input_shape must be positive sizes, got {self.input_shape}")
        if self.features and self.input_shape and math.prod(self.input_shape) != len(self.features):
            raise ValueError(
                f"data.options.input_shape {self.input_shape} holds {math.prod(self.input_shape)} values "
                f"but {len(self.features)} features are listed"
            )
        for column, bounds in self.ranges.items():
            if not (isinstance(bounds, (list, tuple)) and len(bounds) == 2 and float(bounds[0]) <= float(bounds[1])):
                raise ValueError(f"data.options.ranges.{column} must be [min, max] with min <= max, got {bounds!r}")
            if self.features and column not in self.features:
                raise ValueError(f"data.options.ranges.{column}: {column!r} is not one of data.options.features")


def _numeric(kind: pyarrow.DataType) -> bool:
    # A column of nothing but nulls (a CSV with no rows, or with every value missing) holds no text.
    return (
        pyarrow.types.is_integer(kind)
        or pyarrow.types.is_floating(kind)
        or pyarrow.types.is_boolean(kind)
        or pyarrow.types.is_null(kind)
    )


def _text_examples(source: sources.Source, fmt: str, column: str) -> list[str]:
    values = sources.read(source, fmt, [column]).column(0).to_pandas()
    bad = values[pd.to_numeric(values, errors="coerce").isna() & values.notna()]
    return [str(v) for v in bad.unique()[:3]]


class Tabular:
    """Labelled rows from Parquet or CSV files: a local file or directory, or s3://bucket/prefix.

    `streaming` (the `parquet_stream` and `csv_stream` datasets): the data is larger than memory,
    so flyscale validates it a chunk at a time and training streams it (`chunks`).
    """

    options_type = TabularOptions

    def __init__(self, fmt: str, streaming: bool = False):
        self.format = fmt
        self.streaming = streaming
        # Augmenting copies of every row is an in-memory technique: streamed data is not augmented.
        self.default_augmentations = () if streaming else ("gaussian_noise",)  # scaled per column

    def _fmt(self, options: TabularOptions) -> str:
        return options.format or self.format

    def _sources(self, options: TabularOptions) -> list[sources.Source]:
        return sources.listing(options.path, self._fmt(options), versions=False)

    def fingerprint(self, options: TabularOptions) -> str:
        """Each file's version (`sources.listing`): a run learns that new bytes arrived under the
        same path without reading any of them (unless `content_hash` asks it to)."""
        listed = sources.listing(options.path, self._fmt(options), options.content_hash)
        return "\n".join(f"{s.uri} {s.version}" for s in listed)

    def _columns(self, options: TabularOptions, files: list[sources.Source]) -> tuple[list[str], dict[str, str]]:
        """The feature columns and their types, checked against every file's schema."""
        fmt = self._fmt(options)
        first = sources.schema(files[0], fmt)
        skip = {options.label, *options.ignore}
        if options.features:
            features = list(options.features)
        else:
            features = [f.name for f in first if f.name not in skip]
        types: dict[str, str] = {}
        for source in files:
            found = sources.schema(source, fmt)
            if not options.features:  # inferred from the first file: the file a column is missing from is named
                lacking = [c for c in features if c not in found.names]
                more = [c for c in found.names if c not in features and c not in skip]
                why = "the features are inferred from the first file's columns, so every file needs the same ones"
                if lacking:
                    raise ValueError(
                        f"{source.uri} has no column {', '.join(map(repr, lacking))}, which {files[0].uri} has ({why})"
                    )
                if more:  # the first file may be the one short of a column
                    raise ValueError(
                        f"{files[0].uri} has no column {', '.join(map(repr, more))}, which {source.uri} has: "
                        f"unexpected column(s) {more} ({why}). List columns to skip in data.options.ignore, or name "
                        f"the features in data.options.features"
                    )
            self._check_file(options, source, found, features)
            for name in features:
                kind = found.field(name).type
                # Within one batch, integers and floats of one column read as floats (CSV infers per file).
                types[name] = "double" if name in types and types[name] != str(kind) else str(kind)
        return features, types

    def _check_file(
        self, options: TabularOptions, source: sources.Source, found: pyarrow.Schema, features: list[str]
    ) -> None:
        """A file's columns must be exactly the features, the label and the ignored ones, features numeric."""
        names = set(found.names)
        expected = set(features) | {options.label}
        missing = [c for c in [*features, options.label] if c not in names]
        if missing:
            raise ValueError(
                f"{source.uri} has no column {', '.join(map(repr, missing))} (expected the features and the "
                f"label {options.label!r}); it has {found.names}"
            )
        extra = [c for c in found.names if c not in expected and c not in options.ignore]
        if extra:
            raise ValueError(
                f"{source.uri} has unexpected column(s) {extra}: every column must be a feature or the label. "
                f"List columns to skip in data.options.ignore"
                + ("" if options.features else ", or name the features in data.options.features")
            )
        for name in [*features, options.label]:
            kind = found.field(name).type
            if not _numeric(kind):
                examples = _text_examples(source, self._fmt(options), name)
                raise ValueError(
                    f"{source.uri}: column {name!r} holds {kind} values (e.g. {examples}), expected numbers. "
                    f"Fix the file" + ("" if name == options.label else ", or list the column in data.options.ignore")
                )

    def _classes(self, options: TabularOptions, files: list[sources.Source]) -> int:
        """The labels 0..K-1 present without a gap (see the module docstring)."""
        labels = pd.concat(
            [sources.read(s, self._fmt(options), [options.label]).column(0).to_pandas() for s in files],
            ignore_index=True,
        )
        values = pd.to_numeric(labels, errors="coerce")
        present = set(values[(values >= 0) & (values == np.floor(values))].astype("int64").unique())
        k = 0
        while k in present:
            k += 1
        if k == 0:
            raise ValueError(
                f"no label 0 in column {options.label!r} under {options.path!r}: classes are inferred as 0..K-1; "
                f"set data.options.num_classes"
            )
        return k

    def info(self, options: TabularOptions) -> DatasetInfo:
        files = self._sources(options)
        features, types = self._columns(options, files)
        shape = [int(d) for d in options.input_shape] or [len(features)]
        if math.prod(shape) != len(features):
            gaps = _gaps(features)
            raise ValueError(
                f"data.options.input_shape {shape} holds {math.prod(shape)} values, and there are {len(features)} "
                f"features"
                + (f" (inferred from {files[0].uri})" if not options.features else "")
                + (f": {', '.join(map(repr, gaps))} missing from their numbered run" if gaps else f": {features}")
            )
        unknown = sorted(set(options.ranges) - set(features))
        if unknown:
            raise ValueError(f"data.options.ranges names {unknown}, which are not feature columns of {files[0].uri}")
        inferred = [
            name for name, given in (("features", options.features), ("num_classes", options.num_classes)) if not given
        ]
        return DatasetInfo(
            name=f"{self._fmt(options)}:{options.path}",
            num_classes=options.num_classes or self._classes(options, files),
            input_shape=shape,
            feature_columns=features,
            label_column=LABEL,
            feature_ranges={c: [float(b) for b in options.ranges[c]] for c in features if c in options.ranges},
            feature_dtypes=types,
            inferred=inferred,
            root=sources.listed_root(options.path),
        )

    def load(self, options: TabularOptions) -> pd.DataFrame:
        """The feature columns plus `label`, exactly as stored (validation coerces and checks), and
        where each row came from (file and row number), for the quarantine."""
        files = self._sources(options)
        features, _ = self._columns(options, files)
        frames = []
        for source in files:
            frame = sources.read(source, self._fmt(options), [*features, options.label]).to_pandas()
            frame[SOURCE_FILE] = source.uri
            frame[SOURCE_ROW] = np.arange(len(frame), dtype="int64")
            frames.append(frame)
        frame = pd.concat(frames, ignore_index=True).rename(columns={options.label: LABEL})
        return frame[[*features, LABEL, SOURCE_FILE, SOURCE_ROW]]

    def chunks(self, options: TabularOptions, rows: int = 65_536) -> Iterator[pd.DataFrame]:
        """The rows of every file, a chunk at a time, with where each came from (as `load` gives them)."""
        files = self._sources(options)
        features, _ = self._columns(options, files)
        for source in files:
            first = 0
            for batch in sources.batches(source, self._fmt(options), [*features, options.label], rows):
                frame = batch.to_pandas().rename(columns={options.label: LABEL})
                frame[SOURCE_FILE] = source.uri
                frame[SOURCE_ROW] = np.arange(first, first + len(frame), dtype="int64")
                first += len(frame)
                yield frame

    def parts(self, options: TabularOptions) -> list[str]:
        """The files the rows come in (paths or s3:// URIs), in a stable order: the pieces batch
        prediction maps over, a task each."""
        return [s.uri for s in self._sources(options)]

    def part(self, options: TabularOptions, name: str, rows: int = 65_536) -> Iterator[pd.DataFrame]:
        """Every column of the file `name` (one of `parts`), a chunk at a time, with where each row
        came from. No label needed: rows to score have none."""
        source = next((s for s in self._sources(options) if s.uri == name), None)
        if source is None:
            raise ValueError(f"{name!r} is not one of the dataset's files under {options.path!r}")
        columns = sources.schema(source, self._fmt(options)).names
        first = 0
        for batch in sources.batches(source, self._fmt(options), columns, rows):
            frame = batch.to_pandas()
            frame[SOURCE_FILE] = source.uri
            frame[SOURCE_ROW] = np.arange(first, first + len(frame), dtype="int64")
            first += len(frame)
            yield frame


parquet = Tabular("parquet")
csv = Tabular("csv")
parquet_stream = Tabular("parquet", streaming=True)
csv_stream = Tabular("csv", streaming=True)


def _gaps(names: list[str]) -> list[str]:
    """The names a numbered run of columns skips (pixel_0 .. pixel_63 without pixel_17: pixel_17)."""
    runs: dict[str, set[int]] = {}
    for name in names:
        match = re.fullmatch(r"(.*?)(\d+)", name)
        if match:
            runs.setdefault(match.group(1), set()).add(int(match.group(2)))
    return [f"{prefix}{i}" for prefix, seen in runs.items() for i in range(min(seen), max(seen)) if i not in seen]
