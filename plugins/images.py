"""Built-in image datasets that need nothing downloaded: scikit-learn's digits as 1x8x8 images,
and generated 3xNxN images of striped patterns, one pattern per class, of any size, raw or
PNG-encoded (so decoding is exercised). Both hand flyscale typed examples (`examples`), Arrow
batches of an `image` field and a `label` field, never a column per pixel."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa

from flyscale.api import SOURCE_FILE, SOURCE_ROW, DatasetInfo, FieldSpec

PATTERNS = ("horizontal", "vertical", "diagonal", "checkerboard")
BATCH_ROWS = 512  # images handed over at a time


def _batch(images: np.ndarray, labels: np.ndarray, image: FieldSpec, source: str, first: int) -> pa.RecordBatch:
    from flyscale.data.fields import encode_png, to_arrow

    column = (
        pa.array([encode_png(x) for x in images], pa.binary()) if image.encoding == "png" else to_arrow(images, image)
    )
    return pa.record_batch(
        {
            "image": column,
            "label": pa.array(labels.astype("int64")),
            SOURCE_FILE: pa.array([source] * len(labels)),
            SOURCE_ROW: pa.array(np.arange(first, first + len(labels), dtype="int64")),
        }
    )


class DigitsImages:
    """scikit-learn's 1,797 handwritten digits as uint8 1x8x8 images (0..16 scaled to 0..255)."""

    options_type = None
    default_augmentations = ()

    def info(self, options) -> DatasetInfo:
        return DatasetInfo(
            name="digits_images",
            num_classes=10,
            input_shape=[1, 8, 8],
            feature_columns=[],
            fields=[FieldSpec("image", "uint8", [1, 8, 8], range=[0, 255]), FieldSpec("label", "int64", [])],
            input_field="image",
        )

    def fingerprint(self, options) -> str:
        import sklearn

        return f"sklearn.datasets.load_digits {sklearn.__version__}"

    def examples(self, options, shard: str) -> Iterator[pa.RecordBatch]:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = np.rint(digits.images * (255 / 16)).astype("uint8")[:, None]
        yield _batch(images, digits.target, self.info(options).fields[0], "sklearn.datasets.load_digits", 0)


@dataclass
class ShapesOptions:
    rows: int = 3000
    size: int = 32  # images are 3 x size x size
    classes: int = 4  # the first `classes` of PATTERNS
    encoding: str = "raw"  # or "png": the examples arrive as PNG bytes, decoded when validated
    noise: float = 24.0  # std of the Gaussian pixel noise, in uint8 levels
    seed: int = 0
    chunk_rows: int = 1024

    def __post_init__(self):
        if self.rows < 1 or self.chunk_rows < 1:
            raise ValueError(f"rows and chunk_rows must be >= 1, got {self.rows} and {self.chunk_rows}")
        if self.size < 4:
            raise ValueError(f"size must be >= 4 (pixels a side), got {self.size}")
        if not 2 <= self.classes <= len(PATTERNS):
            raise ValueError(f"classes must be in [2, {len(PATTERNS)}] (the patterns {', '.join(PATTERNS)})")
        if self.encoding not in ("raw", "png"):
            raise ValueError(f"encoding must be 'raw' or 'png', got {self.encoding!r}")
        if self.noise < 0:
            raise ValueError(f"noise must be >= 0, got {self.noise}")


class Shapes:
    """Generated 3 x size x size images: stripes of a random period, phase and two random colours,
    one orientation (or a checkerboard) per class, plus pixel noise. Each chunk is a pure function
    of the options and its position, so the data is the same whoever generates it."""

    options_type = ShapesOptions
    default_augmentations = ()

    def info(self, options: ShapesOptions) -> DatasetInfo:
        s = options.size
        encoding = options.encoding
        return DatasetInfo(
            name="shapes",
            num_classes=options.classes,
            input_shape=[3, s, s],
            feature_columns=[],
            fields=[FieldSpec("image", "uint8", [3, s, s], encoding, [0, 255]), FieldSpec("label", "int64", [])],
            input_field="image",
        )

    def fingerprint(self, options: ShapesOptions) -> str:
        return "shapes generator v1 " + json.dumps(asdict(options), sort_keys=True)

    def shards(self, options: ShapesOptions) -> list[str]:
        """One shard per chunk of `chunk_rows` images, generated independently."""
        return [f"{k:05d}" for k in range(math.ceil(options.rows / options.chunk_rows))]

    def examples(self, options: ShapesOptions, shard: str) -> Iterator[pa.RecordBatch]:
        field = self.info(options).fields[0]
        chunk = int(shard)
        first = chunk * options.chunk_rows
        n = min(options.chunk_rows, options.rows - first)
        images, labels = generate(n, options, chunk=chunk)
        for start in range(0, n, BATCH_ROWS):
            part = slice(start, start + BATCH_ROWS)
            yield _batch(images[part], labels[part], field, f"shapes(seed={options.seed})/{shard}", first + start)


def generate(n: int, options: ShapesOptions, chunk: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 images (n, 3, size, size), int64 labels (n,)) of one chunk."""
    rng = np.random.default_rng([options.seed, chunk])
    s = options.size
    labels = rng.integers(0, options.classes, n)
    period = rng.integers(2, max(3, s // 4) + 1, n)[:, None, None]
    phase = rng.integers(0, s, n)[:, None, None]
    yy, xx = np.mgrid[0:s, 0:s]
    stripes = {
        0: (yy[None] + phase) // period,
        1: (xx[None] + phase) // period,
        2: (xx[None] + yy[None] + phase) // period,
        3: (xx[None] + phase) // period + (yy[None] + phase) // period,
    }
    mask = np.zeros((n, s, s), dtype=bool)
    for c in range(options.classes):
        mine = labels == c
        mask[mine] = (stripes[c][mine] % 2).astype(bool)
    # Two colours far apart in every channel, so the pattern, not the colour, tells the class.
    fg = rng.integers(0, 256, (n, 3, 1, 1))
    bg = (fg + rng.integers(96, 161, (n, 3, 1, 1))) % 256
    image = np.where(mask[:, None], fg, bg) + rng.normal(0, options.noise, (n, 3, s, s))
    return np.clip(np.rint(image), 0, 255).astype("uint8"), labels.astype("int64")


digits_images = DigitsImages()
shapes = Shapes()
