"""The `webdataset` layout: tar shards of `KEY.png` beside `KEY.cls`, each streamed a sample at
a time, never extracted."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa

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
from flyscale_plugins.tar_samples import IMAGE_TYPES, class_of, sample_problem, samples


@dataclass
class TarOptions(ImageOptions):
    num_classes: int = 0  # required: inferring it would read every shard

    def __post_init__(self):
        super().__post_init__()
        if self.num_classes < 2:
            raise ValueError(f"num_classes is required and must be >= 2, got {self.num_classes}")


class WebDataset:
    """Tar shards in the WebDataset layout: `KEY.png` (or .jpg, .jpeg) beside `KEY.cls`, the class
    index as text. Every key is one example: one without an image or a readable `.cls` has that
    field null (quarantined as missing); members of other types (`KEY.json`) are ignored."""

    options_type = TarOptions
    default_augmentations = ()

    def info(self, options: TarOptions) -> DatasetInfo:
        """The declared images and classes; no shard is read."""
        return dataset_info("webdataset", options, options.num_classes)

    def fingerprint(self, options: TarOptions) -> str:
        """Each tar file's version."""
        return files_fingerprint("webdataset", options.path, "tar")

    def shards(self, options: TarOptions) -> list[str]:
        """The tar files' URIs."""
        return [s.uri for s in sources.listing(root_uri(options.path), "tar", versions=False)]

    def examples(self, options: TarOptions, shard: str) -> Iterator[pa.RecordBatch]:
        """The tar's samples in order, streamed, `batch_rows` at a time."""
        read = enumerate(samples(shard_source(shard), options.max_image_bytes))
        while part := list(itertools.islice(read, options.batch_rows)):
            images = [next((members[t] for t in IMAGE_TYPES if t in members), None) for _, (_, members, _) in part]
            labels = [class_of(members.get("cls")) for _, (_, members, _) in part]
            problems = [sample_problem(members, problems) for _, (_, members, problems) in part]
            rows, keys = [row for row, _ in part], [key for _, (key, _, _) in part]
            yield example_batch(images, labels, [shard] * len(part), rows, keys, problems)
