"""The `image_parquet` layout: Parquet files of an image column and a label column, as Hugging
Face `datasets` exports them, each file a shard read a row group at a time."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from flyscale.api import DatasetInfo
from flyscale_plugins import sources
from flyscale_plugins.image_records import (
    ImageOptions,
    dataset_info,
    example_batch,
    files_fingerprint,
    root_uri,
    shard_source,
)
from flyscale_plugins.tar_samples import too_large

log = logging.getLogger(__name__)


@dataclass
class ParquetOptions(ImageOptions):
    image_column: str = "image"  # binary, or Hugging Face's Image struct {bytes, path}
    label_column: str = "label"  # integers
    num_classes: int = 0  # 0: max(label) + 1, reading the label column only

    def __post_init__(self):
        super().__post_init__()
        if self.num_classes < 0 or self.num_classes == 1:
            raise ValueError(f"num_classes must be 0 (inferred) or >= 2, got {self.num_classes}")
        if not self.image_column or not self.label_column or self.image_column == self.label_column:
            raise ValueError(
                f"image_column and label_column must name two columns, got {self.image_column!r}, {self.label_column!r}"
            )


def _is_bytes(kind: pa.DataType) -> bool:
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind)


class ImageParquet:
    """Parquet files of an image column (binary, or Hugging Face's Image struct `{bytes, path}`)
    and an integer label column; each file is a shard, read a row group at a time. A row's key is
    its image's `path` where the struct has one, else its row number."""

    options_type = ParquetOptions
    default_augmentations = ()

    def _files(self, options: ParquetOptions) -> list[sources.Source]:
        return sources.listing(root_uri(options.path), "parquet", versions=False)

    def _check(self, source: sources.Source, options: ParquetOptions) -> pa.DataType:
        """The image column's type, once the file is known to have both columns of usable types."""
        schema = sources.schema(source, "parquet")
        for option in ("image_column", "label_column"):
            if getattr(options, option) not in schema.names:
                raise ValueError(
                    f"{source.uri} has no column {getattr(options, option)!r} ({option}); it has {schema.names}"
                )
        image, label = schema.field(options.image_column).type, schema.field(options.label_column).type
        struct = pa.types.is_struct(image) and image.get_field_index("bytes") >= 0
        if not (_is_bytes(image) or (struct and _is_bytes(image.field("bytes").type))):
            raise ValueError(
                f"{source.uri}: column {options.image_column!r} (image_column) is {image}; expected "
                f"image bytes: binary, or a struct of bytes and path (Hugging Face's Image)"
            )
        if not pa.types.is_integer(label):
            raise ValueError(
                f"{source.uri}: column {options.label_column!r} (label_column) is {label}; expected "
                f"integer class indexes"
            )
        return image

    def _num_classes(self, options: ParquetOptions, files: list[sources.Source]) -> int:
        """max(label) + 1 over every file, reading the label column alone."""
        found = []
        for source in files:
            self._check(source, options)
            found.append(pc.max(sources.read(source, "parquet", [options.label_column]).column(0)).as_py())
        top = max((v for v in found if v is not None), default=None)
        if top is None or top < 1:
            raise ValueError(
                f"cannot infer num_classes from column {options.label_column!r} under {options.path!r}: its "
                f"largest label is {top}. Set num_classes"
            )
        log.info("image_parquet: inferred num_classes %d from %s", top + 1, options.path)
        return top + 1

    def info(self, options: ParquetOptions) -> DatasetInfo:
        """The declared images; the classes given, or inferred from the label column alone."""
        files = self._files(options)
        if options.num_classes:
            self._check(files[0], options)  # one footer: a misnamed column fails before any shard starts
            return dataset_info("image_parquet", options, options.num_classes)
        return dataset_info("image_parquet", options, self._num_classes(options, files), inferred=True)

    def fingerprint(self, options: ParquetOptions) -> str:
        """Each file's version, and which columns hold the image and the label."""
        return files_fingerprint("image_parquet", options.path, "parquet", options.image_column, options.label_column)

    def shards(self, options: ParquetOptions) -> list[str]:
        """The Parquet files' URIs."""
        return [s.uri for s in self._files(options)]

    def examples(self, options: ParquetOptions, shard: str) -> Iterator[pa.RecordBatch]:
        """The file's rows, a row group at a time: the image bytes as stored, the label as int64."""
        source, columns, first = shard_source(shard), [options.image_column, options.label_column], 0
        kind = self._check(source, options)
        for batch in sources.batches(source, "parquet", columns, options.batch_rows):
            image, rows = batch.column(options.image_column), pa.array(range(first, first + batch.num_rows), pa.int64())
            keys = rows.cast(pa.string())
            if pa.types.is_struct(kind):
                if kind.get_field_index("path") >= 0:  # the file HF read the image from: what a user can look up
                    keys = pc.coalesce(pc.struct_field(image, "path"), keys)
                image = pc.struct_field(image, "bytes")
            labels, image = batch.column(options.label_column).cast(pa.int64()), image.cast(pa.binary())
            sizes = pc.binary_length(image).to_pylist()
            cap = options.max_image_bytes
            problems = [too_large("an image", n, cap) if n is not None and n > cap else None for n in sizes]
            if any(problems):  # handed on without its bytes, which the quarantine would otherwise keep
                image = pc.if_else(
                    pa.array([p is not None for p in problems]), pa.nulls(len(image), pa.binary()), image
                )
            yield example_batch(image, labels, [shard] * batch.num_rows, rows, keys, problems)
            first += batch.num_rows
