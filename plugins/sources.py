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

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import pyarrow
import pyarrow.dataset as ds
import pyarrow.fs as pafs

EXTENSIONS = {
    "parquet": (".parquet", ".pq"),
    "csv": (".csv", ".csv.gz"),
    "images": (".png", ".jpg", ".jpeg"),
    "tar": (".tar",),
    "text": (".txt", ".md", ".rst"),
    "jsonl": (".jsonl",),
}
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
    version: str  # what changes whenever its bytes can have changed (see `listing`)
    size: int = -1  # bytes, as listed (-1: not listed, e.g. a shard named by its URI)


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def _s3_endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def _s3_region() -> str:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


def filesystem(uri: str) -> pafs.FileSystem:
    """The filesystem `uri` lives on."""
    if not is_s3(uri):
        return pafs.LocalFileSystem()
    return pafs.S3FileSystem(
        endpoint_override=_s3_endpoint(),
        region=_s3_region(),
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


def listed_root(uri: str) -> str:
    """`uri` in the form `listing` names its files under: an S3 URI as given, a local path with
    `~` expanded (a relative path stays relative, as its files' names do)."""
    return uri if is_s3(uri) else str(Path(uri).expanduser())


def listing(uri: str, fmt: str, content_hash: bool = False, versions: bool = True) -> list[Source]:
    """Every `fmt` file at `uri` (a file, a directory, or an s3:// prefix), in sorted order, each
    with a version that changes whenever its bytes can have changed:

    - a local file: its size, mtime, ctime and inode. A tool can set the mtime back (`cp -p`,
      `rsync -t`, `tar x`, `os.utime`), but every write moves the ctime, and no tool sets it;
    - an S3 object: its ETag and size, from the bucket's listing (an overwrite within the same
      second, at the same size, has another ETag);
    - with `content_hash`, the sha256 of the file's bytes instead, for a filesystem where
      neither can be trusted (every file is read in full, on every run).

    `versions=False` lists the files only (their versions empty), for reading them.
    """
    fs, root = filesystem(uri), listed_root(uri).removeprefix("s3://")
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
    paths = [i.path for i in files]
    sizes = {i.path: i.size for i in files}
    if not versions:
        found = dict.fromkeys(paths, "")
    elif content_hash:
        found = {p: "sha256:" + _content_sha256(fs, p, uri) for p in paths}
    elif is_s3(uri):
        found = _s3_versions(root, paths, uri)
    else:
        found = {p: _local_version(p) for p in paths}
    prefix = "s3://" if is_s3(uri) else ""
    return [Source(prefix + p, p, found[p], sizes[p]) for p in paths]


def _local_version(path: str) -> str:
    st = os.stat(path)
    return f"size={st.st_size} mtime={st.st_mtime_ns} ctime={st.st_ctime_ns} inode={st.st_ino}"


def _s3_versions(root: str, paths: list[str], uri: str) -> dict[str, str]:
    """{bucket/key: "size=... etag=..."} for `paths`, from one listing of the prefix they share.
    (pyarrow's listing has no ETag; boto3's has, from the same credentials and endpoint.)"""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, prefix = root.partition("/")
    client = boto3.client(
        "s3",
        endpoint_url=_s3_endpoint(),
        region_name=_s3_region(),
        config=Config(retries={"max_attempts": S3_ATTEMPTS, "mode": "standard"}),
    )
    found: dict[str, str] = {}
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                found[f"{bucket}/{obj['Key']}"] = f"size={obj['Size']} etag={obj['ETag'].strip(chr(34))}"
    except (BotoCoreError, ClientError) as exc:
        raise readable(exc, uri, "listing") from exc
    missing = [p for p in paths if p not in found]
    if missing:  # gone between the two listings: the data is changing under us
        raise ValueError(f"data.options.path {uri!r}: {missing[0]} vanished while the data was being listed")
    return {p: found[p] for p in paths}


def _content_sha256(fs: pafs.FileSystem, path: str, uri: str) -> str:
    import hashlib

    digest = hashlib.sha256()
    try:
        with fs.open_input_stream(path) as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError as exc:
        raise readable(exc, uri, "reading") from exc
    return digest.hexdigest()


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


@contextlib.contextmanager
def open_file(source: Source) -> Iterator[BinaryIO]:
    """The file, to read a piece at a time from anywhere in it; a failure names it."""
    try:
        with filesystem(source.uri).open_input_file(source.path) as f:
            yield f
    except OSError as exc:
        raise readable(exc, source.uri, "reading") from exc


def read_bytes(source: Source) -> bytes:
    """The whole file (an image, a tar shard, a text file)."""
    try:
        with filesystem(source.uri).open_input_stream(source.path) as f:
            return f.read()
    except OSError as exc:
        raise readable(exc, source.uri, "reading") from exc
