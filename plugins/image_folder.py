"""The `image_folder` layout: `path/CLASS/NAME.png`, a subfolder per class, each file read
whole, many at once, into batches of bounded size."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.fs as pafs

from flyscale.api import DatasetInfo
from flyscale_plugins import sources
from flyscale_plugins.image_records import ImageOptions, dataset_info, example_batch, files_fingerprint, root_uri
from flyscale_plugins.tar_samples import too_large

READERS = 16  # files read at once: an S3 GET waits on latency, not bandwidth
BATCH_BYTES = 256 << 20  # image bytes handed over at a time, at most (and batch_rows of them)


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
        base = root_uri(options.path).removeprefix("s3://").rstrip("/") + "/"
        found = []
        for s in sources.listing(root_uri(options.path), "images", versions=False):
            key = s.path.removeprefix(base)
            folder, inside, _ = key.partition("/")
            if not inside or key == s.path:
                raise ValueError(f"{s.uri} is not in a class subfolder of {options.path!r}: move it into one")
            if not folder.startswith("."):
                found.append((s, folder, key))
        return found

    def _layout(self, options: FolderOptions) -> tuple[list[str], list[tuple[sources.Source, int, str]]]:
        """The classes, and every image with its label and its path below the root."""
        root, images = root_uri(options.path), self._images(options)
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
        return dataset_info("image_folder", options, len(self._layout(options)[0]))

    def fingerprint(self, options: FolderOptions) -> str:
        """Each image's version, and the label order."""
        return files_fingerprint("image_folder", options.path, "images", options.classes)

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
                    yield example_batch(
                        [d if isinstance(d, bytes) else None for d, _ in part],
                        [label for _, (_, label, _) in part],
                        [s.uri for _, (s, _, _) in part],
                        [0] * len(part),
                        [k for _, (_, _, k) in part],
                        [d if isinstance(d, str) else None for d, _ in part],
                    )
                    part, held = [], 0
