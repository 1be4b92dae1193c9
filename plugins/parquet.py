"""The `parquet` dataset: labelled rows from Parquet files on local disk or in S3.

`path` is a single file, a directory (every *.parquet beneath it) or `s3://bucket/prefix`
(every *.parquet object under the prefix). S3 goes through boto3, which reads credentials and
`AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3` itself, so MinIO or a test server works unchanged.
Shards are read in sorted key order, so the same files give the same frame from disk or S3.

What a run may assume about the data is declared in the options (features, ranges, classes)
and checked row by row by `row_schema`, so bad rows are quarantined instead of trained on.
`info` and `row_schema` read only the Parquet footer and the label column when they must infer
something; declare `features` and `num_classes` and they read nothing at all.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd
import pandera.pandas as pa
import pyarrow
import pyarrow.parquet as pq

from flyscale.api import DatasetInfo, default_row_schema

LABEL = "label"  # the column name every later stage relies on


@dataclass
class ParquetOptions:
    path: str = ""  # required; a default only so a missing path gets the clear message below
    label: str = "label"  # source column holding the class; renamed to `label` on load
    features: list[str] = field(default_factory=list)  # empty: every other numeric column
    num_classes: int = 0  # 0: infer from the labels (max + 1)
    input_shape: list[int] = field(default_factory=list)  # empty: [number of features]
    ranges: dict = field(default_factory=dict)  # {column: [min, max]}, checked per row

    def __post_init__(self):
        if not str(self.path).strip():
            raise ValueError(
                "data.options.path is required: a Parquet file, a directory of *.parquet files, "
                "or an s3://bucket/prefix URI"
            )
        if self.path.startswith("s3://") and not self.path[len("s3://"):].split("/")[0]:
            raise ValueError(f"data.options.path {self.path!r} names no bucket; expected s3://bucket/prefix")
        if not self.label.strip():
            raise ValueError("data.options.label must name the label column")
        if len(set(self.features)) != len(self.features):
            raise ValueError(f"data.options.features lists a column twice: {self.features}")
        if self.label in self.features or LABEL in self.features:
            # The label is renamed to `label` on load; a feature of either name would collide.
            raise ValueError(f"data.options.features must not include {self.label!r} or {LABEL!r}")
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


# --- where the bytes come from ------------------------------------------------------------


def _split_s3(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    return bucket, prefix


def _s3_client():
    import boto3

    return boto3.client("s3")  # endpoint, region and credentials come from the environment


def _s3_error(exc: Exception, path: str) -> Exception:  # exc: a botocore BotoCoreError or ClientError
    """Network hiccups are worth a retry (Flyte retries recoverable errors); the rest are config."""
    from botocore.exceptions import ClientError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    transient = ("SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable")
    code = exc.response.get("Error", {}).get("Code") if isinstance(exc, ClientError) else None
    if isinstance(exc, BotoConnectionError) or code in transient:
        from flytekit.exceptions.user import FlyteRecoverableException

        return FlyteRecoverableException(f"reading {path}: {exc}")
    return ValueError(f"data.options.path {path!r} cannot be read from S3: {exc}")


def _listing(path: str) -> list[tuple[str, str]]:
    """(source, version) for every Parquet file under `path`, sorted, as local paths or s3:// URIs.

    The version is what changes when the bytes do, without reading them: an object's ETag and
    size on S3, a file's size and modification time on disk.
    """
    if path.startswith("s3://"):
        from botocore.exceptions import BotoCoreError, ClientError

        bucket, prefix = _split_s3(path)
        # "data/shards" must not also match "data/shards-old/": list a directory-like prefix.
        if prefix and not prefix.endswith((".parquet", "/")):
            prefix += "/"
        try:
            pages = _s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            objects = sorted((o["Key"], f"{o['ETag']}:{o['Size']}") for page in pages for o in page.get("Contents", []))
        except (BotoCoreError, ClientError) as exc:
            raise _s3_error(exc, path) from exc
        found = [(f"s3://{bucket}/{key}", version) for key, version in objects if key.endswith(".parquet")]
    else:
        local = Path(path).expanduser()
        if local.is_file():
            files = [local]
        elif local.is_dir():
            files = sorted(local.rglob("*.parquet"), key=lambda p: p.relative_to(local).as_posix())
        else:
            raise ValueError(f"data.options.path {path!r} does not exist")
        found = [(str(f), f"{f.stat().st_size}:{f.stat().st_mtime_ns}") for f in files]
    if not found:
        raise ValueError(f"data.options.path {path!r} holds no .parquet files")
    return found


def _sources(path: str) -> list[str]:
    """Every Parquet file under `path`, sorted."""
    return [source for source, _ in _listing(path)]


def _open(source: str) -> pq.ParquetFile:
    if source.startswith("s3://"):
        bucket, key = _split_s3(source)
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            body = _s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
        except (BotoCoreError, ClientError) as exc:
            raise _s3_error(exc, source) from exc
        return pq.ParquetFile(io.BytesIO(body))
    return pq.ParquetFile(source)


def _files(path: str) -> Iterator[tuple[str, pq.ParquetFile]]:
    for source in _sources(path):
        yield source, _open(source)


# --- reading --------------------------------------------------------------------------------


def _numeric(kind: pyarrow.DataType) -> bool:
    return pyarrow.types.is_integer(kind) or pyarrow.types.is_floating(kind)


def _features(options: ParquetOptions, first: str, schema: pyarrow.Schema) -> list[str]:
    """The declared features, or every numeric column of the first file except the label."""
    if options.features:
        return list(options.features)
    found = [f.name for f in schema if f.name not in (options.label, LABEL) and _numeric(f.type)]
    if not found:
        raise ValueError(f"{first} has no numeric feature columns besides the label {options.label!r}")
    unknown = sorted(set(options.ranges) - set(found))
    if unknown:
        raise ValueError(f"data.options.ranges names {unknown}, which are not numeric feature columns of {first}")
    return found


def _read(options: ParquetOptions, label_only: bool = False) -> tuple[pd.DataFrame, list[str]]:
    """Rows of every file (only the label column if `label_only`) and the feature column names."""
    frames, features = [], None
    for source, pfile in _files(options.path):
        schema = pfile.schema_arrow
        if features is None:
            features = _features(options, source, schema)
        wanted = ([] if label_only else features) + [options.label]
        missing = [c for c in wanted if c not in schema.names]
        if missing:
            raise ValueError(
                f"{source} has no column {', '.join(map(repr, missing))} "
                f"(data.options.{'label' if missing == [options.label] else 'features'}); it has {schema.names}"
            )
        frames.append(pfile.read(columns=wanted).to_pandas())
    frame = pd.concat(frames, ignore_index=True)
    return frame.rename(columns={options.label: LABEL})[([] if label_only else features) + [LABEL]], features


def _feature_names(options: ParquetOptions) -> list[str]:
    if options.features:
        return list(options.features)
    source = _sources(options.path)[0]
    return _features(options, source, _open(source).schema_arrow)


def _num_classes(options: ParquetOptions) -> int:
    if options.num_classes:
        return options.num_classes
    labels = pd.to_numeric(_read(options, label_only=True)[0][LABEL], errors="coerce")
    # Invalid labels (negative, NaN, text) are the schema's business; they must not size the model.
    labels = labels[(labels >= 0) & (labels == np.floor(labels))]
    if labels.empty:
        raise ValueError(f"no usable labels in column {options.label!r} under {options.path!r}; set data.options.num_classes")
    return int(labels.max()) + 1


class Parquet:
    """Labelled rows from Parquet files: local file/directory or s3://bucket/prefix."""

    options_type = ParquetOptions
    default_augmentations = ("gaussian_noise",)  # scaled per column: fits features of any units

    def load(self, options: ParquetOptions) -> pd.DataFrame:
        """The feature columns plus `label`, exactly as stored (validation coerces and checks)."""
        return _read(options)[0]

    def fingerprint(self, options: ParquetOptions) -> str:
        """Each file's version (S3: ETag and size; disk: size and mtime), read from the listing
        alone: a run learns that new bytes arrived under the same path without reading them."""
        return "\n".join(f"{source} {version}" for source, version in _listing(options.path))

    def info(self, options: ParquetOptions) -> DatasetInfo:
        features = _feature_names(options)
        shape = [int(d) for d in options.input_shape] or [len(features)]
        if math.prod(shape) != len(features):
            raise ValueError(f"data.options.input_shape {shape} does not hold the {len(features)} features {features}")
        return DatasetInfo(
            name=f"parquet:{options.path}", num_classes=_num_classes(options), input_shape=shape,
            feature_columns=features, label_column=LABEL,
            feature_ranges={c: [float(b) for b in options.ranges[c]] for c in features if c in options.ranges},
        )

    def row_schema(self, options: ParquetOptions) -> pa.DataFrameSchema:
        """Features: float, non-null, finite, inside their declared range. Label: a whole number in [0, num_classes)."""
        return default_row_schema(self.info(options))


parquet = Parquet()
