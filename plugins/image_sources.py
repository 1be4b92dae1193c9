"""Your images, in the three layouts they are usually kept in, on local disk or under an `s3://`
prefix (plugins/sources.py): a folder per class (`image_folder`), WebDataset tar shards
(`webdataset`), and Parquet files as Hugging Face `datasets` exports them (`image_parquet`).

Each hands flyscale every image's bytes exactly as stored, never decoded: flyscale decodes and
checks them itself (the size from the header first), and quarantines an image that does not
decode or is not the declared size, with its origin (`_source_file`, `_source_row`,
`_source_key`). What has no image or no label (a WebDataset sample without its `.png` or its
`.cls`, a `.cls` that is not an integer, a Parquet row whose image or label is null) arrives with
that field null, which flyscale quarantines as missing: it never stops a run, and is never
dropped unseen.

What cannot be read safely is not read, and comes with its reason (`_source_problem`): a file,
tar member or Parquet cell larger than `max_image_bytes`, a tar member that is a link, a device
or a directory where an image or class should be, or whose name points outside the archive
(`../x.png`, `/etc/x.png`). Nothing is ever extracted to disk, and a link is never followed.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from flyscale.api import SOURCE_FILE, SOURCE_KEY, SOURCE_PROBLEM, SOURCE_ROW, DatasetInfo, FieldSpec
from flyscale_plugins import sources
from flyscale_plugins.tar_samples import IMAGE_TYPES, class_of, sample_problem, samples, too_large

log = logging.getLogger(__name__)

BATCH_ROWS = 512  # images handed over at a time
READERS = 16  # files read at once: an S3 GET waits on latency, not bandwidth
MAX_IMAGE_BYTES = 32 << 20  # a larger image file is quarantined unread (a 4096x4096 RGB PNG is ~50 MB raw)
BATCH_BYTES = 256 << 20  # image bytes handed over at a time, at most (and batch_rows of them)


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


@dataclass
class FolderOptions(ImageOptions):
    classes: list[str] = field(default_factory=list)  # the label order; empty: the subfolders' names, sorted
    files_per_shard: int = 1000

    def __post_init__(self):
        super().__post_init__()
        if self.files_per_shard < 1:
            raise ValueError(f"files_per_shard must be >= 1, got {self.files_per_shard}")
        if len(set(self.classes)) != len(self.classes) or any(not c or "/" in c for c in self.classes):
            raise ValueError(f"classes must be distinct subfolder names, got {self.classes}")


@dataclass
class TarOptions(ImageOptions):
    num_classes: int = 0  # required: inferring it would read every shard

    def __post_init__(self):
        super().__post_init__()
        if self.num_classes < 2:
            raise ValueError(f"num_classes is required and must be >= 2, got {self.num_classes}")


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


def _info(name: str, options: ImageOptions, num_classes: int, inferred: bool = False) -> DatasetInfo:
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
    )


def _batch(
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


def _root(path: str) -> str:
    """`path` as the URI every origin names: an S3 URI as given, a local path absolute."""
    return path if sources.is_s3(path) else str(Path(path).expanduser().resolve())


def _source(uri: str) -> sources.Source:
    """A shard's file from its URI, without listing the whole dataset again."""
    return sources.Source(uri, uri[len("s3://") :] if sources.is_s3(uri) else uri, "")


def _read(fs: pafs.FileSystem, source: sources.Source, cap: int) -> bytes | str:
    """The whole file, as `sources.read_bytes` reads it, on a filesystem shared by many reads; or,
    for a file larger than `cap`, why it was not read (no more than `cap` + 1 bytes are read)."""
    try:
        with fs.open_input_stream(source.path) as f:
            data = f.read(cap + 1)
            if len(data) > cap:
                return too_large("a file", None, cap)  # not read on to count it: it may never end
            return data
    except OSError as exc:
        raise sources.readable(exc, source.uri, "reading") from exc


def _in_order(pool: ThreadPoolExecutor, read: Callable, items: Iterable) -> Iterator:
    """`read(item)` for each item in order, at most 2 x READERS read ahead: held bytes stay bounded."""
    ahead: collections.deque[Future] = collections.deque()
    for item in items:
        ahead.append(pool.submit(read, item))
        if len(ahead) >= 2 * READERS:
            yield ahead.popleft().result()
    while ahead:
        yield ahead.popleft().result()


def _fingerprint(name: str, path: str, fmt: str, *settings: object) -> str:
    """Each file's version (`sources.listing`), and the options that change what the files mean."""
    listed = [(s.uri, s.version) for s in sources.listing(_root(path), fmt)]
    return f"{name} sha256:" + hashlib.sha256(json.dumps([listed, *settings]).encode()).hexdigest()


class ImageFolder:
    """`path/CLASS/NAME.png` (or .jpg, .jpeg), one subfolder per class, its label the subfolder's
    index in `classes`; other files are ignored, as are hidden subfolders (`.ipynb_checkpoints`).
    The files in sorted order, cut into groups of `files_per_shard`, are the shards."""

    options_type = FolderOptions
    default_augmentations = ()

    def _subfolders(self, root: str) -> set[str]:
        """The root's visible subfolders, images in them or not (an S3 prefix's common prefixes)."""
        fs = sources.filesystem(root)
        try:
            found = fs.get_file_info(pafs.FileSelector(root.removeprefix("s3://").rstrip("/")))
        except OSError as exc:
            raise sources.readable(exc, root, "listing") from exc
        return {i.base_name for i in found if i.type == pafs.FileType.Directory and not i.base_name.startswith(".")}

    def _images(self, options: FolderOptions) -> list[tuple[sources.Source, str, str]]:
        """Every image not in a hidden folder: (file, its class folder, its path below the root)."""
        base = _root(options.path).removeprefix("s3://").rstrip("/") + "/"
        found = []
        for s in sources.listing(_root(options.path), "images", versions=False):
            key = s.path.removeprefix(base)
            folder, inside, _ = key.partition("/")
            if not inside or key == s.path:
                raise ValueError(f"{s.uri} is not in a class subfolder of {options.path!r}: move it into one")
            if not folder.startswith("."):
                found.append((s, folder, key))
        return found

    def _layout(self, options: FolderOptions) -> tuple[list[str], list[tuple[sources.Source, int, str]]]:
        """The classes, and every image with its label and its path below the root."""
        root, images = _root(options.path), self._images(options)
        filled = {folder for _, folder, _ in images}
        present = self._subfolders(root) | filled
        classes = list(options.classes) or sorted(present)
        if present - set(classes):
            raise ValueError(
                f"{options.path!r} has subfolder(s) {sorted(present - set(classes))} that are not in classes "
                f"{classes}: add them to classes, or move them out"
            )
        for name in classes:
            if name not in filled:
                raise ValueError(f"{root.rstrip('/')}/{name} holds no .png, .jpg or .jpeg images")
        if len(classes) < 2:
            raise ValueError(f"{options.path!r} must hold a subfolder per class, at least 2; it has {classes}")
        label = {c: i for i, c in enumerate(classes)}
        return classes, [(s, label[folder], key) for s, folder, key in images]

    def info(self, options: FolderOptions) -> DatasetInfo:
        """One class per subfolder; the folder is listed, no image is read."""
        return _info("image_folder", options, len(self._layout(options)[0]))

    def fingerprint(self, options: FolderOptions) -> str:
        """Each image's version, and the label order."""
        return _fingerprint("image_folder", options.path, "images", options.classes)

    def shards(self, options: FolderOptions) -> list[str]:
        """The groups' indexes, zero-padded so that they sort in order."""
        count = math.ceil(len(self._layout(options)[1]) / options.files_per_shard)
        width = max(5, len(str(count - 1)))
        return [f"{k:0{width}d}" for k in range(count)]

    def examples(self, options: FolderOptions, shard: str) -> Iterator[pa.RecordBatch]:
        """The group's images, each file's bytes as stored, read a batch at a time and many at once."""
        files = self._layout(options)[1]
        first = int(shard) * options.files_per_shard if shard.isdigit() else len(files)
        group = files[first : first + options.files_per_shard]
        if not group:
            raise ValueError(f"image_folder has no shard {shard!r}: {options.path!r} changed since it was sharded")
        fs = sources.filesystem(options.path)  # one for all: making an S3 one takes ~15 ms
        read = lambda s: _read(fs, s, options.max_image_bytes)  # noqa: E731
        with ThreadPoolExecutor(READERS) as pool:
            part: list[tuple[bytes | str, tuple[sources.Source, int, str]]] = []
            held = 0  # image bytes in `part`
            for n, item in enumerate(zip(_in_order(pool, read, [s for s, _, _ in group]), group, strict=True), 1):
                part.append(item)
                held += len(item[0]) if isinstance(item[0], bytes) else 0
                if len(part) == options.batch_rows or held >= BATCH_BYTES or n == len(group):
                    yield _batch(
                        [d if isinstance(d, bytes) else None for d, _ in part],
                        [label for _, (_, label, _) in part],
                        [s.uri for _, (s, _, _) in part],
                        [0] * len(part),
                        [k for _, (_, _, k) in part],
                        [d if isinstance(d, str) else None for d, _ in part],
                    )
                    part, held = [], 0


class WebDataset:
    """Tar shards in the WebDataset layout: `KEY.png` (or .jpg, .jpeg) beside `KEY.cls`, the class
    index as text. Every key is one example: one without an image or a readable `.cls` has that
    field null (quarantined as missing); members of other types (`KEY.json`) are ignored."""

    options_type = TarOptions
    default_augmentations = ()

    def info(self, options: TarOptions) -> DatasetInfo:
        """The declared images and classes; no shard is read."""
        return _info("webdataset", options, options.num_classes)

    def fingerprint(self, options: TarOptions) -> str:
        """Each tar file's version."""
        return _fingerprint("webdataset", options.path, "tar")

    def shards(self, options: TarOptions) -> list[str]:
        """The tar files' URIs."""
        return [s.uri for s in sources.listing(_root(options.path), "tar", versions=False)]

    def examples(self, options: TarOptions, shard: str) -> Iterator[pa.RecordBatch]:
        """The tar's samples in order, streamed, `batch_rows` at a time."""
        read = enumerate(samples(_source(shard), options.max_image_bytes))
        while part := list(itertools.islice(read, options.batch_rows)):
            images = [next((members[t] for t in IMAGE_TYPES if t in members), None) for _, (_, members, _) in part]
            labels = [class_of(members.get("cls")) for _, (_, members, _) in part]
            problems = [sample_problem(members, problems) for _, (_, members, problems) in part]
            rows, keys = [row for row, _ in part], [key for _, (key, _, _) in part]
            yield _batch(images, labels, [shard] * len(part), rows, keys, problems)


def _is_bytes(kind: pa.DataType) -> bool:
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind)


class ImageParquet:
    """Parquet files of an image column (binary, or Hugging Face's Image struct `{bytes, path}`)
    and an integer label column; each file is a shard, read a row group at a time. A row's key is
    its image's `path` where the struct has one, else its row number."""

    options_type = ParquetOptions
    default_augmentations = ()

    def _files(self, options: ParquetOptions) -> list[sources.Source]:
        return sources.listing(_root(options.path), "parquet", versions=False)

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
            return _info("image_parquet", options, options.num_classes)
        return _info("image_parquet", options, self._num_classes(options, files), inferred=True)

    def fingerprint(self, options: ParquetOptions) -> str:
        """Each file's version, and which columns hold the image and the label."""
        return _fingerprint("image_parquet", options.path, "parquet", options.image_column, options.label_column)

    def shards(self, options: ParquetOptions) -> list[str]:
        """The Parquet files' URIs."""
        return [s.uri for s in self._files(options)]

    def examples(self, options: ParquetOptions, shard: str) -> Iterator[pa.RecordBatch]:
        """The file's rows, a row group at a time: the image bytes as stored, the label as int64."""
        source, columns, first = _source(shard), [options.image_column, options.label_column], 0
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
            yield _batch(image, labels, [shard] * batch.num_rows, rows, keys, problems)
            first += batch.num_rows


image_folder = ImageFolder()
webdataset = WebDataset()
image_parquet = ImageParquet()
