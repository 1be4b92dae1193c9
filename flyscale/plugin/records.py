"""The records that cross a plugin boundary, and the conversion of a plugin's own objects into them.

What a plugin returns (a dataset's info, a gate's verdict) may be any object with the fields of
`DatasetInfo` or `GateVerdict`, or a mapping of them: flyscale converts it where it receives it
(`as_dataset_info`, `as_gate_verdict`), so a plugin package may depend on flyscale not at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ENCODINGS = ("raw", "png", "jpeg")
DTYPES = ("uint8", "int32", "int64", "float32", "string")


@dataclass
class FieldSpec:
    """One field of every example: what it holds, per example, once decoded.

    - `image: uint8[3, 32, 32]` is FieldSpec("image", "uint8", [3, 32, 32]); PNG or JPEG bytes
      decoded to that are the same with encoding="png" (or "jpeg": either decodes either).
    - `tokens: int32[<= 512]` is FieldSpec("tokens", "int32", [512], variable=True).
    - `features: float32[64]` is FieldSpec("features", "float32", [64]).
    - `label: int64` is FieldSpec("label", "int64", []); `text: string` is FieldSpec("text",
      "string", []), a document that must decode as UTF-8 and not be empty.

    Between tasks a field travels as one Arrow column (a fixed-size list of its elements, a list
    when `variable`), never as a column per element.
    """

    name: str
    dtype: str  # one of DTYPES
    shape: list[int]  # per example; [] for a scalar
    encoding: str = "raw"  # one of ENCODINGS: how the dataset hands the field over
    # [low, high] every element must lie in (an image's uint8 pixels: [0, 255]; token ids:
    # [0, vocabulary - 1]); None: only the dtype's own limits.
    range: list[float] | None = None
    variable: bool = False  # the (one) dimension is a maximum: each example has 1..shape[0] elements

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"field {self.name!r}: dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"field {self.name!r}: encoding {self.encoding!r} is not one of {', '.join(ENCODINGS)}")
        if any(int(d) < 1 for d in self.shape):
            raise ValueError(f"field {self.name!r}: every dimension of shape {self.shape} must be >= 1")
        if self.encoding != "raw" and (self.dtype != "uint8" or len(self.shape) != 3 or self.shape[0] not in (1, 3)):
            raise ValueError(
                f"field {self.name!r}: {self.encoding} decodes to uint8 images (C, H, W) with C 1 or 3, "
                f"not {self.dtype}{self.shape}"
            )
        if self.dtype == "string" and (self.shape or self.range is not None):
            raise ValueError(f"field {self.name!r}: a string field is one document per example: shape [] and no range")
        if self.variable and len(self.shape) != 1:
            raise ValueError(f"field {self.name!r}: variable=True needs one dimension (its maximum), not {self.shape}")

    def __str__(self) -> str:
        encoded = "" if self.encoding == "raw" else f" ({self.encoding})"
        dims = ("<= " if self.variable else "") + ", ".join(str(d) for d in self.shape)
        return f"{self.name}: {self.dtype}{f'[{dims}]' if self.shape else ''}{encoded}"


@dataclass
class DatasetInfo:
    """Shape facts the model builder, augmentation and evaluation need; travels between tasks.

    A dataset of typed examples (images, text, ...) declares `fields`: the model's input is the
    field named `input_field` and the class is the field named `label_column` ("" for examples
    without one, such as a text corpus, with `num_classes` 0), and models receive the input as a
    tensor of its declared shape. A table leaves `fields` empty: its numeric `feature_columns`
    are the input, one float32 `features` tensor (N, len(feature_columns)).
    """

    name: str
    num_classes: int
    input_shape: list[int]  # per example, e.g. [1, 8, 8]; a table's features arrive flattened
    feature_columns: list[str]
    label_column: str = "label"
    # {column: [min, max]} the dataset guarantees; augmented rows are clipped back inside them.
    feature_ranges: dict[str, list[float]] = field(default_factory=dict)
    feature_dtypes: dict[str, str] = field(default_factory=dict)  # {column: type as stored}, where known
    # What the dataset inferred from the data instead of being told ("features", "num_classes"):
    # flyscale pins it with the model and holds later batches to it.
    inferred: list[str] = field(default_factory=list)
    fields: list[FieldSpec] = field(default_factory=list)
    input_field: str = ""  # with `fields`: the one models take
    # The folder or s3:// prefix the origins' files (SOURCE_FILE) lie under, in the form they are
    # named: the split hashes each file's path below it, so the same files split the same way
    # wherever they sit (another folder, or uploaded to S3). "" hashes the whole name.
    root: str = ""

    def input(self) -> FieldSpec | None:
        """The field models take, for a dataset of typed examples; None for a table."""
        return next((f for f in self.fields if f.name == self.input_field), None)


# Columns a dataset's load() may add to say where each row came from; flyscale keeps them out of
# the checks and puts them beside every quarantined row.
SOURCE_FILE = "_source_file"
SOURCE_ROW = "_source_row"
# Typed examples may also name each example within its file (a tar member's key, an image's
# path): kept beside a quarantined example, so the user can find it.
SOURCE_KEY = "_source_key"
# ... and say why an example could not be read whole (a tar member over the size cap, a link, a
# line longer than the cap), as a reason in flyscale's form, `field: check (got what was found)`:
# the example is quarantined with that reason alone, its fields as they came (usually null).
SOURCE_PROBLEM = "_source_problem"


@dataclass
class GateVerdict:
    """A gate's decision, with the reason a person reads in the summary and in MLflow."""

    name: str
    passed: bool
    reason: str


@dataclass
class ObjectiveContext:
    """What an objective's evaluation and served model may need besides the model and batches."""

    info: DatasetInfo
    bytes_per_token: float = 0.0  # text: UTF-8 bytes a token of the training split (bits per byte)
    tokenizer_json: str = ""  # text: the tokenizer (flyscale.data.text.from_json), to decode samples


def cost_name(metric: str, higher_is_better: bool) -> str:
    """What int8's cost on `metric` is called (recorded as `int8_<this>`): how much worse the int8
    model is, `<metric>_drop` where higher is better and `<metric>_increase` where lower is."""
    return f"{metric}_drop" if higher_is_better else f"{metric}_increase"


def costed(metrics: Mapping[str, bool]) -> dict[str, bool]:
    """The objective's metrics int8's cost is recorded on: all but its speeds (`*_per_s`), which
    are the latency comparison's to judge."""
    return {m: up for m, up in metrics.items() if not m.endswith("_per_s")}


def _fields(obj: Any, names: Sequence[str], what: str, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Read `names` from an object's attributes or a mapping's keys; name what is missing."""
    get = obj.get if isinstance(obj, Mapping) else lambda n, d=None: getattr(obj, n, d)
    missing = object()
    out = {}
    for name in names:
        value = get(name, missing)
        if value is missing:
            if name not in defaults:
                raise TypeError(f"{what} has no field {name!r} (got {type(obj).__name__}: {obj!r})")
            value = defaults[name]
        out[name] = value
    return out


def as_dataset_info(obj: Any, where: str) -> DatasetInfo:
    """Any object with DatasetInfo's fields, as a DatasetInfo; `where` names the plugin."""
    info = obj if isinstance(obj, DatasetInfo) else _converted_info(obj, where)
    names = [x.name for x in info.fields]
    labelled = info.label_column != ""
    if info.fields and (info.input_field not in names or (labelled and info.label_column not in names)):
        raise TypeError(
            f"{where}: info() declares fields {names}; input_field ({info.input_field!r}) and label_column "
            f'({info.label_column!r}, or "" for examples without a label) must each name one of them'
        )
    return info


def _converted_info(obj: Any, where: str) -> DatasetInfo:
    names = (
        "name",
        "num_classes",
        "input_shape",
        "feature_columns",
        "label_column",
        "feature_ranges",
        "feature_dtypes",
        "inferred",
        "fields",
        "input_field",
        "root",
    )
    defaults = {
        "label_column": "label",
        "feature_ranges": {},
        "feature_dtypes": {},
        "inferred": [],
        "fields": [],
        "input_field": "",
        "root": "",
    }
    f = _fields(obj, names, f"{where}: info()", defaults)
    try:
        return DatasetInfo(
            name=str(f["name"]),
            num_classes=int(f["num_classes"]),
            input_shape=[int(d) for d in f["input_shape"]],
            feature_columns=[str(c) for c in f["feature_columns"]],
            label_column=str(f["label_column"]),
            feature_ranges={str(k): [float(lo), float(hi)] for k, (lo, hi) in dict(f["feature_ranges"]).items()},
            feature_dtypes={str(k): str(v) for k, v in dict(f["feature_dtypes"]).items()},
            inferred=[str(v) for v in f["inferred"]],
            fields=[_as_field(v, where) for v in f["fields"]],
            input_field=str(f["input_field"]),
            root=str(f["root"]),
        )
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{where}: info() returned fields of the wrong type: {exc}") from exc


def _as_field(obj: Any, where: str) -> FieldSpec:
    if isinstance(obj, FieldSpec):
        return obj
    f = _fields(
        obj,
        ("name", "dtype", "shape", "encoding", "range", "variable"),
        f"{where}: info() field",
        {"encoding": "raw", "range": None, "variable": False},
    )
    bounds = None if f["range"] is None else [float(v) for v in f["range"]]
    shape = [int(d) for d in f["shape"]]
    return FieldSpec(str(f["name"]), str(f["dtype"]), shape, str(f["encoding"]), bounds, bool(f["variable"]))


def as_gate_verdict(obj: Any, where: str) -> GateVerdict:
    """Any object with GateVerdict's fields, as a GateVerdict; `where` names the plugin."""
    if isinstance(obj, GateVerdict):
        return obj
    f = _fields(obj, ("name", "passed", "reason"), f"{where}: check()", {})
    passed = f["passed"]
    # A verdict decides publication: only a real boolean counts, never a truthy string or list.
    if not isinstance(passed, (bool, np.bool_)):
        raise TypeError(f"{where}: check() returned passed={passed!r}; it must be True or False")
    return GateVerdict(name=str(f["name"]), passed=bool(passed), reason=str(f["reason"]))
