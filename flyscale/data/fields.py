"""Typed fields as Arrow columns, and Arrow columns back as the arrays models take.

A field of fixed shape travels as a fixed-size list of its elements, one per example (an image
of 3x32x32 is one column of 3,072-element lists, not 3,072 columns); a scalar as a plain column;
an encoded image (PNG, JPEG) arrives as binary and is decoded once, when it is validated, to the
declared dtype and shape. What training reads is decided in one place, `Reader`, for a table's
feature columns and for a field alike.

Imported by DataLoader workers: numpy and pyarrow only (PIL when an image is decoded).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from flyscale.plugin.records import DatasetInfo, FieldSpec


def size(field: FieldSpec) -> int:
    """Elements per example."""
    return math.prod(field.shape)


def arrow_type(field: FieldSpec) -> pa.DataType:
    """How the field is stored in the splits flyscale writes (decoded)."""
    if field.dtype == "string":
        return pa.string()
    element = pa.from_numpy_dtype(np.dtype(field.dtype))
    if field.variable:
        return pa.list_(element)
    return pa.list_(element, size(field)) if field.shape else element


ROW_GROUP_BYTES = 32 * 2**20  # of decoded examples: what one streaming read holds
STRING_BYTES = 2048  # what a document is taken to weigh, for that


def row_group_rows(info: DatasetInfo) -> int:
    """Examples per row group of a split: the tables' 65,536, fewer where examples are large (a
    3x32x32 image is 3 KB: 10,922 of them), so that a streaming read stays small."""
    example = sum(STRING_BYTES if f.dtype == "string" else size(f) * np.dtype(f.dtype).itemsize for f in info.fields)
    return int(max(256, min(65_536, ROW_GROUP_BYTES // max(1, example))))


def split_schema(info: DatasetInfo, keep_encoded: bool = False) -> pa.Schema:
    """The columns of a split of typed examples: each field (encoded images as binary when they
    are kept encoded), then where each example came from."""
    columns = [(f.name, pa.binary() if keep_encoded and f.encoding != "raw" else arrow_type(f)) for f in info.fields]
    return pa.schema([*columns, ("source_file", pa.string()), ("source_row", pa.int64()), ("source_key", pa.string())])


def to_arrow(values: np.ndarray, field: FieldSpec) -> pa.Array:
    """Decoded values (as flyscale.data.example_checks makes them) as the field's column."""
    if field.dtype == "string":
        return pa.array(list(values), pa.string())
    if field.variable:
        lengths = np.array([len(v) for v in values], dtype="int32")
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype("int32")
        flat = np.concatenate(list(values)) if len(values) else np.zeros(0)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.astype(field.dtype)))
    values = np.ascontiguousarray(values, dtype=field.dtype)
    if not field.shape:
        return pa.array(values)
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), size(field))


def to_numpy(column: pa.Array | pa.ChunkedArray, field: FieldSpec) -> np.ndarray:
    """A stored column as the field's values: (N, *shape) of its dtype, decoding images kept
    encoded; an object array of documents or of variable-length sequences."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_binary(column.type) and field.dtype != "string":
        return decode_images(column, field)
    if field.dtype == "string":
        return np.array(column.to_pylist(), dtype=object)
    if field.variable:
        flat = column.flatten().to_numpy(zero_copy_only=False).astype(field.dtype, copy=False)
        lengths = column.value_lengths().to_numpy(zero_copy_only=False)
        out = np.empty(len(column), dtype=object)
        out[:] = np.split(flat, np.cumsum(lengths)[:-1]) if len(column) else []
        return out
    if not field.shape:
        return column.to_numpy(zero_copy_only=False).astype(field.dtype, copy=False)
    flat = column.flatten().to_numpy(zero_copy_only=False)  # flatten() honours the array's offset
    return flat.reshape(len(column), *field.shape).astype(field.dtype, copy=False)


def stored_values(table: pa.Table, info: DatasetInfo) -> dict[str, np.ndarray]:
    """Every field of a split's rows, as values (what duplicates are compared by)."""
    return {f.name: to_numpy(table.column(f.name), f) for f in info.fields}


# uint8 pixels are divided by this before a model sees them: the scale image models are built for.
# The served model divides by the value its serving JSON records (flyscale/export/onnx_pyfunc/predictor.py).
PIXEL_DIVISOR = 255.0


def decode_images(column: pa.Array, field: FieldSpec) -> np.ndarray:
    """Encoded images kept in a split (already validated) as uint8 (N, C, H, W)."""
    out = np.empty((len(column), *field.shape), dtype="uint8")
    for i, data in enumerate(column.to_pylist()):
        out[i] = decode_image(data, field)
    return out


class WrongSize(ValueError):
    """An image whose header declares another size than the field's: refused before a pixel is
    decoded (a decompression bomb declares billions of them). `shape`: (C, H, W) as it would decode."""

    def __init__(self, shape: list[int], want: list[int]):
        self.shape = shape
        super().__init__(f"an image of {shape[1]}x{shape[2]} pixels, not the {want[1]}x{want[2]} declared")


def decode_image(data: bytes, field: FieldSpec) -> np.ndarray:
    """PNG or JPEG bytes as uint8 (C, H, W), C from the field; ValueError when they do not decode,
    WrongSize (before decoding) when the header declares another height and width."""
    from PIL import Image, UnidentifiedImageError

    kind = "an image"  # until PIL has read the header: then what it found, PNG or JPEG
    try:
        with Image.open(io.BytesIO(data)) as image:  # over Pillow's pixel cap: DecompressionBombError
            kind = f"a {image.format}" if image.format else kind
            width, height = image.size
            if [height, width] != list(field.shape[1:]):
                raise WrongSize([field.shape[0], height, width], list(field.shape))
            image.load()
            pixels = np.asarray(image.convert("L" if field.shape[0] == 1 else "RGB"), dtype="uint8")
    except WrongSize:
        raise
    except UnidentifiedImageError:
        raise ValueError("bytes that are not an image PIL can read (PNG, JPEG, ...)") from None
    except Image.DecompressionBombError as exc:  # an Exception, not a ValueError: a bomb must not end the run
        raise ValueError(f"{kind} of too many pixels to decode (a decompression bomb?): {exc}") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise ValueError(f"{kind} that does not decode: {exc}") from None
    return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)


def encode_png(image: np.ndarray) -> bytes:
    """uint8 (C, H, W) with C 1 or 3 as PNG bytes."""
    from PIL import Image

    hwc = image[0] if image.shape[0] == 1 else image.transpose(1, 2, 0)
    out = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(hwc, dtype="uint8")).save(out, format="PNG")
    return out.getvalue()


@dataclass(frozen=True)
class Reader:
    """What training reads from a split's shards: (inputs, labels) arrays.

    A table's feature columns are stacked into float32 (N, features). A field is read at its
    declared shape: floats as float32, integer ids (tokens) as int64, and uint8 images as float32
    in [0, 1] (pixel / 255), the scale image models are built for. `read_stored` keeps a field as
    stored (an image as uint8: a quarter of the memory, for a streaming buffer) and `to_model`
    converts a batch of it; `read` is both.
    """

    label: str  # "" for examples without one (a text corpus): the labels read are zeros
    features: tuple[str, ...] = ()
    field: FieldSpec | None = None
    label_dtype: str = "int64"  # a class; "float32" for a real-valued target

    @property
    def columns(self) -> list[str]:
        inputs = [self.field.name] if self.field is not None else list(self.features)
        return [*inputs, self.label] if self.label else inputs

    def read(self, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        x, y = self.read_stored(table)
        return self.to_model(x), y

    def read_stored(self, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        """(inputs as stored, decoded: uint8 images stay uint8; labels int64, or float32 targets)."""
        if self.field is None:
            x = np.stack([table.column(c).to_numpy().astype("float32", copy=False) for c in self.features], axis=1)
        else:
            x = to_numpy(table.column(self.field.name), self.field)
        if not self.label:
            return np.array(x), np.zeros(table.num_rows, dtype="int64")
        # Copies: arrow's zero-copy arrays are read-only, and torch warns on tensors over them.
        return np.array(x), np.array(table.column(self.label).to_numpy(), dtype=self.label_dtype)

    def to_model(self, x: np.ndarray) -> np.ndarray:
        """A batch as stored, as models take it."""
        if self.field is None or self.field.dtype == "float32":
            return np.asarray(x, dtype="float32")
        if self.field.dtype == "uint8":
            return x.astype("float32") / PIXEL_DIVISOR
        return np.asarray(x, dtype="int64")

    def empty(self) -> np.ndarray:
        """No rows of inputs as stored, with the right trailing shape and dtype (to start a buffer)."""
        if self.field is None:
            return np.empty((0, len(self.features)), dtype="float32")
        return np.empty((0, *self.field.shape), dtype=self.field.dtype)

    def example_bytes(self) -> int:
        """Bytes of one example's inputs as stored."""
        if self.field is None:
            return 4 * max(1, len(self.features))
        return size(self.field) * np.dtype(self.field.dtype).itemsize


def real_target(info: DatasetInfo) -> FieldSpec | None:
    """The label's field when it holds real values (a regression target), not a class; else None."""
    label = next((f for f in info.fields if f.name == info.label_column), None) if info.label_column else None
    return label if label is not None and label.dtype.startswith("float") else None


def reader(info: DatasetInfo) -> Reader:
    """The reader for a dataset: its input field, or its table's feature columns."""
    field = info.input()
    label_dtype = "float32" if real_target(info) is not None else "int64"
    if field is not None:
        return Reader(label=info.label_column, field=field, label_dtype=label_dtype)
    return Reader(label=info.label_column, features=tuple(info.feature_columns), label_dtype=label_dtype)


def input_example(info: DatasetInfo, rows: int = 2) -> np.ndarray:
    """Zeros shaped as models receive them: what a serving signature or a dummy batch is made of."""
    return np.zeros((rows, *model_input_shape(info)), dtype="float32")


def model_input_shape(info: DatasetInfo) -> list[int]:
    """The per-example shape models receive: the input field's, or (features,) for a table."""
    field = info.input()
    return list(field.shape) if field is not None else [len(info.feature_columns)]
