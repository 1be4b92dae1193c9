"""Where tabular bytes come from: files on local disk or objects in S3, read through pyarrow's
dataset layer (column projection; only a Parquet footer when only the schema is needed; S3 read
by ranges, never one whole object downloaded to read one column).

S3 goes through pyarrow's S3FileSystem. Credentials come from the standard AWS chain
(`AWS_ACCESS_KEY_ID` and friends, a profile, a role); the endpoint from `AWS_ENDPOINT_URL_S3`
or `AWS_ENDPOINT_URL`, so MinIO or a test server works unchanged; the region from `AWS_REGION`
or `AWS_DEFAULT_REGION`. Transient failures are retried by the AWS SDK's standard retry
strategy; when the attempts run out they become Flyte-recoverable errors, so Flyte's retries
apply. Every other failure names the file and says what to do.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow
import pyarrow.dataset as ds
import pyarrow.fs as pafs

EXTENSIONS = {"parquet": (".parquet", ".pq"), "csv": (".csv", ".csv.gz")}
S3_ATTEMPTS = 5  # the AWS SDK's standard retry strategy: exponential backoff with jitter

# AWS SDK error names in pyarrow's messages, by what they mean for the user.
TRANSIENT = (
    "NETWORK_CONNECTION",
    "SLOW_DOWN",
    "THROTTLING",
    "SERVICE_UNAVAILABLE",
    "INTERNAL_FAILURE",
    "REQUEST_TIMEOUT",
    "REQUEST_TIME_TOO_SKEWED",
    "HTTP status 5",
    "HTTP response code: 5",
)
DENIED = (
    "ACCESS_DENIED",
    "INVALID_ACCESS_KEY_ID",
    "SIGNATURE_DOES_NOT_MATCH",
    "UNRECOGNIZED_CLIENT",
    "MISSING_AUTHENTICATION_TOKEN",
    "EXPIRED_TOKEN",
    "HTTP status 403",
    "HTTP response code: 403",
)


@dataclass(frozen=True)
class Source:
    """One file of a dataset."""

    uri: str  # as the user names it: /abs/path/part-0.parquet or s3://bucket/key
    path: str  # as the filesystem names it: the local path, or bucket/key
    version: str  # what changes when its bytes do: size and modification time


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def filesystem(uri: str) -> pafs.FileSystem:
    """The filesystem `uri` lives on."""
    if not is_s3(uri):
        return pafs.LocalFileSystem()
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return pafs.S3FileSystem(
        endpoint_override=endpoint,
        region=region,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=S3_ATTEMPTS),
    )


def readable(exc: Exception, uri: str, doing: str) -> Exception:
    """A pyarrow or AWS failure as an error that names the file and what to do."""
    from flytekit.exceptions.user import FlyteRecoverableException

    text = str(exc)
    if any(code in text for code in TRANSIENT):
        return FlyteRecoverableException(f"{doing} {uri} failed after {S3_ATTEMPTS} attempts: {text}")
    if any(code in text for code in DENIED):
        return ValueError(
            f"{doing} {uri}: access denied. Check the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            f"AWS_PROFILE, or the role) and that they may read this bucket. ({text})"
        )
    if "NO_SUCH_BUCKET" in text:
        return ValueError(f"{doing} {uri}: the bucket does not exist (data.options.path). ({text})")
    if "NO_SUCH_KEY" in text or "Path does not exist" in text or isinstance(exc, FileNotFoundError):
        return ValueError(f"{doing} {uri}: no such file or object (data.options.path). ({text})")
    if "magic bytes" in text or "Parquet file size is 0" in text or "deserialize" in text or "Couldn't" in text:
        return ValueError(
            f"{uri} is not a readable Parquet file: it is truncated, corrupted, or in another format "
            f"(pyarrow: {text.splitlines()[-1]}). Rewrite it, or remove it from data.options.path."
        )
    if "CSV" in text:
        return ValueError(f"{uri} is not readable as CSV (pyarrow: {text.splitlines()[-1]}). Fix the file.")
    return ValueError(f"{doing} {uri} failed: {text}")


def listing(uri: str, fmt: str) -> list[Source]:
    """Every `fmt` file at `uri` (a file, a directory, or an s3:// prefix), in sorted order."""
    fs, root = filesystem(uri), (uri[len("s3://") :] if is_s3(uri) else str(Path(uri).expanduser()))
    try:
        info = fs.get_file_info(root)
        if info.type == pafs.FileType.File:
            infos = [info]
        else:
            # "data/shards" must not also match "data/shards-old/": list it as a directory.
            infos = fs.get_file_info(pafs.FileSelector(root.rstrip("/"), recursive=True, allow_not_found=True))
    except OSError as exc:
        raise readable(exc, uri, "listing") from exc
    if info.type == pafs.FileType.NotFound and not infos:
        bucket = root.split("/")[0]
        if is_s3(uri) and fs.get_file_info(bucket).type == pafs.FileType.NotFound:
            raise ValueError(f"data.options.path {uri!r}: the bucket {bucket!r} does not exist")
        raise ValueError(f"data.options.path {uri!r} does not exist")
    files = sorted(
        (i for i in infos if i.type == pafs.FileType.File and i.path.endswith(EXTENSIONS[fmt])), key=lambda i: i.path
    )
    if not files:
        raise ValueError(f"data.options.path {uri!r} holds no {' or '.join(EXTENSIONS[fmt])} files")
    prefix = "s3://" if is_s3(uri) else ""
    return [Source(prefix + i.path, i.path, f"{i.size}:{i.mtime_ns}") for i in files]


def _dataset(source: Source, fs: pafs.FileSystem, fmt: str) -> ds.Dataset:
    return ds.dataset(source.path, filesystem=fs, format=fmt)


def schema(source: Source, fmt: str) -> pyarrow.Schema:
    """The file's columns and types: a Parquet footer, or the first block of a CSV."""
    try:
        return _dataset(source, filesystem(source.uri), fmt).schema
    except (OSError, pyarrow.ArrowException) as exc:
        raise readable(exc, source.uri, "reading the schema of") from exc


def read(source: Source, fmt: str, columns: list[str]) -> pyarrow.Table:
    """Only `columns` of the file."""
    try:
        return _dataset(source, filesystem(source.uri), fmt).to_table(columns=columns)
    except (OSError, pyarrow.ArrowException) as exc:
        raise readable(exc, source.uri, "reading") from exc


def batches(source: Source, fmt: str, columns: list[str], rows: int) -> Iterator[pyarrow.RecordBatch]:
    """The file's `columns` in batches of about `rows` rows (Parquet by row group, CSV by block),
    so a file larger than memory is read a piece at a time."""
    try:
        scanner = _dataset(source, filesystem(source.uri), fmt).scanner(columns=columns, batch_size=rows)
        yield from scanner.to_batches()
    except (OSError, pyarrow.ArrowException) as exc:
        raise readable(exc, source.uri, "reading") from exc
