"""What every image layout shares: the options common to all three, the DatasetInfo each
declares, the record batches each hands flyscale (bytes, label, origin, problem), and where
its files are and which versions they have."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from flyscale.api import SOURCE_FILE, SOURCE_KEY, SOURCE_PROBLEM, SOURCE_ROW, DatasetInfo, FieldSpec
from flyscale_plugins import sources

BATCH_ROWS = 512  # images handed over at a time
MAX_IMAGE_BYTES = 32 << 20  # a larger image file is quarantined unread (a 4096x4096 RGB PNG is ~50 MB raw)


@dataclass
class ImageOptions:
    path: str = ""  # required; a default only so a missing path gets the clear message below
    channels: int = 3  # 1 (grey) or 3 (RGB): what every image is decoded to
    height: int = 32  # the declared size: an image of another size is quarantined
    width: int = 32
    batch_rows: int = BATCH_ROWS
    max_image_bytes: int = MAX_IMAGE_BYTES  # a larger file, tar member or cell is quarantined, never read

    def __post_init__(self):
        if not str(self.path).strip():
            raise ValueError("path is required: a directory, a file, or an s3://bucket/prefix URI")
        if sources.is_s3(self.path) and not self.path[len("s3://") :].split("/")[0]:
            raise ValueError(f"path {self.path!r} names no bucket; expected s3://bucket/prefix")
        if self.channels not in (1, 3):
            raise ValueError(f"channels must be 1 (grey) or 3 (RGB), got {self.channels}")
        for name in ("height", "width", "batch_rows", "max_image_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def dataset_info(name: str, options: ImageOptions, num_classes: int, inferred: bool = False) -> DatasetInfo:
    """What the layout `name` declares: images of the options' shape, `num_classes` labels."""
    shape = [options.channels, options.height, options.width]
    return DatasetInfo(
        name=f"{name}:{options.path}",
        num_classes=num_classes,
        input_shape=shape,
        feature_columns=[],
        label_column="label",
        inferred=["num_classes"] if inferred else [],
        fields=[FieldSpec("image", "uint8", shape, "png", [0, 255]), FieldSpec("label", "int64", [])],
        input_field="image",
        root=root_uri(options.path),
    )


def example_batch(
    images: Sequence, labels: Sequence, files: list[str], rows: Sequence, keys: Sequence, problems: Sequence = ()
) -> pa.RecordBatch:
    """Examples as flyscale takes them: image bytes, label, where each came from, and what could not be read."""
    return pa.record_batch(
        {
            "image": pa.array(images, pa.binary()),
            "label": pa.array(labels, pa.int64()),
            SOURCE_FILE: pa.array(files, pa.string()),
            SOURCE_ROW: pa.array(rows, pa.int64()),
            SOURCE_KEY: pa.array(keys, pa.string()),
            SOURCE_PROBLEM: pa.array(list(problems) or [None] * len(files), pa.string()),
        }
    )


def root_uri(path: str) -> str:
    """`path` as the URI every origin names: an S3 URI as given, a local path absolute."""
    return path if sources.is_s3(path) else str(Path(path).expanduser().resolve())


def shard_source(uri: str) -> sources.Source:
    """A shard's file from its URI, without listing the whole dataset again."""
    return sources.Source(uri, uri[len("s3://") :] if sources.is_s3(uri) else uri, "")


def files_fingerprint(name: str, path: str, fmt: str, *settings: object) -> str:
    """Each file's version (`sources.listing`), and the options that change what the files mean."""
    listed = [(s.uri, s.version) for s in sources.listing(root_uri(path), fmt)]
    return f"{name} sha256:" + hashlib.sha256(json.dumps([listed, *settings]).encode()).hexdigest()
