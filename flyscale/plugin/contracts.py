"""What crosses a plugin boundary: the Protocol each kind of plugin satisfies, the types plugins
hand back, and the conversion of a plugin's own objects into those types.

flyscale uses a plugin by its shape: an object (or a class with a no-argument constructor)
registered under an entry point, e.g. in the plugin package's pyproject.toml:

    [project.entry-points."flyscale.models"]
    acme_resnet = "acme_flyscale.models:resnet"

When the registry loads a plugin it checks it against its kind's Protocol below (every method
present, callable, and accepting the arguments flyscale passes), so a plugin of the wrong shape
is refused before any task starts. What a plugin returns (a dataset's info, a gate's verdict)
may be any object with the fields of `DatasetInfo` or `GateVerdict`, or a mapping of them:
flyscale converts it where it receives it. Plugin authors who want the types import them from
`flyscale.api`, the stable re-export of this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:  # for the annotations only: configs and the plugin registry load without torch (3 s)
    import pandas as pd
    from torch import nn


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


class DatasetPlugin(Protocol):
    """A source of labelled rows: one `label` column plus numeric feature columns.

    Optional: `row_schema(options)`, a pandera DataFrameSchema whose row-level failures send
    rows to quarantine (without one, flyscale checks what `info` declares: finite features
    inside `feature_ranges`, labels in [0, num_classes), no other columns); `options_type` (a
    dataclass of the plugin's options, or None); `default_augmentations` (augmentation names
    that fit this data, used when the config leaves `augment.names` unset; none if absent);
    `fingerprint(options) -> str`, a cheap identity of the data as it is now (the built-in
    file datasets use each file's size and modification time, so a rewrite that keeps both is not
    seen): every run takes it, and loading re-runs only when it changes. Without one, every run loads the data to hash its content.
    `streaming = True` with `chunks(options)`, an iterator of frames like `load`'s: the data is
    larger than memory, so flyscale validates it chunk by chunk and training streams it.
    `objective` (default "classification"): the objective the data is for; a run with another
    one is registered under a name of its own (flyscale.config.publishing.default_model_name).

    A dataset of typed examples (images, text, ...) declares its `fields` in `info` and has
    `examples(options, shard)` instead of `load`: an iterator of `pyarrow.RecordBatch`es of one
    shard, one column per field (a fixed-size list or a list of numbers, binary for encoded
    images, string or binary for text, or a scalar), and the origin columns `_source_file` and
    `_source_row` (the file or object, and the example's position in it). Optional
    `shards(options)`: the names of the pieces the data comes in (files, objects, tar shards), in
    a stable order; flyscale prepares them as a Flyte map task, a pod each on a cluster, and
    combines what they found. A dataset without `shards` is one piece, and `shard` is "".

    Optional `parts(options)` and `part(options, name)`: the pieces (files) a dataset of rows
    comes in, and every column of one piece as frames with the origin columns (no label needed).
    `batch_predict` scores a dataset a piece at a time, a Flyte map task each.
    flyscale validates each field, quarantines bad examples with their origin and reason,
    de-duplicates across shards and splits by origin, however large the data.
    """

    def load(self, options: Any) -> pd.DataFrame: ...

    def info(self, options: Any) -> DatasetInfo: ...


class ModelPlugin(Protocol):
    """Builds a fresh model: any nn.Module for DDP. The pipeline strategy (and activation
    checkpointing) split it between layers, so for them return an `nn.Sequential`."""

    def build(self, options: Any, info: DatasetInfo) -> nn.Module: ...


class AugmentationPlugin(Protocol):
    """Transforms a batch of examples, shape (N, *input_shape), deterministically given `rng`.

    The result keeps the batch's shape. flyscale clips it into the dataset's `feature_ranges`.
    """

    def __call__(self, x: np.ndarray, rng: np.random.Generator, options: Any) -> np.ndarray: ...


@dataclass(frozen=True)
class StrategyTraits:
    """What a strategy is, as the trainer, the preflight and the launcher need to know it: one
    record a strategy declares as its `traits` attribute, read through `traits_of`."""

    # train.batch_size rows per worker, the global batch that times the workers; False when every
    # worker sees the same global batch (pipelining).
    per_worker_batch: bool = True
    # The model arrives on the meta device: the strategy materialises only this rank's part.
    meta_model: bool = False
    # Its checkpoints (DTensors, through DCP) resume on another number of workers, the global
    # batch kept; the restart directory is then keyed without the worker count.
    reshards: bool = False


def traits_of(strategy: Any) -> StrategyTraits:
    """`strategy`'s traits: its `traits` record, or the defaults. A package written against no
    flyscale may give any object of the same fields, and one written before the record set them
    as loose attributes of the strategy: both are read here, and nowhere else."""
    declared = getattr(strategy, "traits", None)
    if isinstance(declared, StrategyTraits):
        return declared
    source = strategy if declared is None else declared
    names = [f for f in StrategyTraits.__dataclass_fields__ if hasattr(source, f)]
    return StrategyTraits(**{name: bool(getattr(source, name)) for name in names})


def fixed_workers(strategy: Any, options: Any) -> int | None:
    """The number of workers `options` fix, for a strategy with `workers(options)` (hybrid's
    mesh); None where the launcher decides. (Here, below config, which asks it.)"""
    method = getattr(strategy, "workers", None)
    return method(options) if method is not None else None


class StrategyPlugin(Protocol):
    """A model transform: `parallelize` applies the parallelism to `model` on this rank and says,
    in a `flyscale.api.Parallelized`, what the trainer needs to train it (the module to step and
    checkpoint, the evaluator, a step of its own where the standard one does not do, the
    collectives' clock, the loader where it differs, how rank 0 gets the whole model back). The
    trainer (`flyscale.api.train`) owns the rest: optimizer, scheduler, step, epochs, checkpoints.

    Optional attribute `traits` (flyscale.api.StrategyTraits; default: its defaults):
    `per_worker_batch`, `meta_model`, `reshards`.
    Optional method `check(model, cfg, options, world_size)`: raise ValueError, naming the layer
    or setting and the way out, for a model (built on the meta device) or a config this strategy
    cannot train at that world size. It runs before any data is read.
    Optional method `replicas(options, world_size)`: how many data-parallel replicas share the
    global batch, where that is neither every worker nor one (hybrid: the mesh's dp).
    Optional method `workers(options)`: the number of workers these options fix (hybrid's mesh),
    or None; a local run starts that many.

    The older form, a callable `(model, data, cfg, ctx, options, hooks)` that trains by itself
    and returns a TrainResult, is still run as it is (passing `hooks` on to `fit`).
    """

    # data: flyscale.api.TrainData, cfg: TrainConfig, ctx: DistContext; returns a Parallelized.
    # (Those live with the training loop, which is built on config, which is built on this module.)
    def parallelize(self, model: nn.Module, data: Any, cfg: Any, ctx: Any, options: Any) -> Any: ...


class QuantizerPlugin(Protocol):
    """Returns a quantized copy of a trained float model (the input is left untouched).

    Optional attribute `calibrates` (default False): True when the quantizer observes data (static
    quantization). flyscale then calls `quantize(model, options, calibration)`, calibration a
    list of float32 feature batches of the training split, each (batch, n_features) flattened
    as every model receives them. Its output's architecture must depend on the model alone, not
    on the calibration values: to load saved int8 weights, flyscale rebuilds the architecture by
    calibrating on a synthetic batch, and the state_dict brings back the real scales.

    Optional attribute `works_on` (default "torch"): "onnx" for a quantizer of the exported
    model. Then `model` is the fp32 ONNX file's Path, `quantize` returns the int8 ONNX file's
    Path, and `calibration` is a list of numpy batches of the ONNX model's input. The int8 model
    is then served as the fp32 one is, by ONNX Runtime alone.
    """

    def quantize(self, model: nn.Module, options: Any) -> nn.Module: ...


class GatePlugin(Protocol):
    """Decides whether a candidate's test metrics are good enough to publish.

    Optional: `compares_champion = True`: the gate compares the candidate with the champion, so
    flyscale scores the champion's registered model on the candidate's test split first and
    `champion` holds those metrics, with `scored` 1.0 (0.0, and the champion's recorded metrics,
    when it could not be scored there). Without it `champion` holds the recorded metrics."""

    def check(
        self, metrics: Mapping[str, float], options: Any, champion: Mapping[str, float] | None
    ) -> GateVerdict: ...


@dataclass
class ObjectiveContext:
    """What an objective's evaluation and served model may need besides the model and batches."""

    info: DatasetInfo
    bytes_per_token: float = 0.0  # text: UTF-8 bytes a token of the training split (bits per byte)
    tokenizer_json: str = ""  # text: the tokenizer (flyscale.data.text.from_json), to decode samples


class Evaluator(Protocol):
    """Metrics streamed over the test split's batches: memory holds what the metrics need, never
    the split. `update` gets the model's outputs and the targets of one batch (after `pair`);
    `result` returns flyscale.api.EvalMetrics with `objective`, `loss`, `n` and `values` set (a
    classifier fills its own fields too)."""

    def update(self, outputs: Any, targets: Any) -> None: ...

    def result(self) -> Any: ...


def cost_name(metric: str, higher_is_better: bool) -> str:
    """What int8's cost on `metric` is called (recorded as `int8_<this>`): how much worse the int8
    model is, `<metric>_drop` where higher is better and `<metric>_increase` where lower is."""
    return f"{metric}_drop" if higher_is_better else f"{metric}_increase"


def costed(metrics: Mapping[str, bool]) -> dict[str, bool]:
    """The objective's metrics int8's cost is recorded on: all but its speeds (`*_per_s`), which
    are the latency comparison's to judge."""
    return {m: up for m, up in metrics.items() if not m.endswith("_per_s")}


class ObjectivePlugin(Protocol):
    """What training optimises, what evaluation measures, and what the served model returns.

    `loss(outputs, targets)`: the mean loss of a batch, what the optimizer follows.
    `score(outputs, targets)`: (summed loss, hits, count) of a batch, as 0-d tensors but count an
    int: validation sums them over batches and ranks, so its loss is the mean per counted target
    (an example, or a token) and its accuracy hits / count (the top-1 class, or next token).
    `evaluator(context)`: a fresh Evaluator for the test split.
    `metrics`: {name or glob: True when higher is better} of what the evaluator reports; the
    gates may bound these (and `loss`, `size_bytes`, latencies); `headline` names the one metric
    that sums the objective up (one of `metrics`).
    Optional `pair(x, y)`: what the model is given and what it is scored against, from a batch
    of the dataset (default: the inputs and the labels; a language model predicts each token
    from those before it: (x[:, :-1], x[:, 1:])).
    Optional `samples(model, context)`: {prompt: what the model made of it}, shown in the Deck and
    MLflow (a language model's continuation of fixed prompts).
    Optional `with_options(options)`: the objective configured with its parsed options (an
    instance of `options_type`); flyscale calls it once and uses what it returns.
    Optional `predict(model, model_input, params, context)` and `example(context)`: what the
    registered model returns for an input (MLflow pyfunc's `predict`, `params` its inference
    params) and (an input example, default params or None), which its signature is inferred
    from. Without them the served model takes float32 inputs and returns the raw outputs.
    Optional `serving(context)`: how the registered model answers without flyscale, from its ONNX
    export (flyscale/export/onnx_pyfunc/predictor.py): {"output": "probabilities"}, {"output": "values",
    "scalar": bool}, or {"output": "text", "window": int, "max_new_tokens": int, "temperature":
    float}. An objective with its own `predict` and no `serving` is registered as a PyTorch model
    that needs flyscale and its plugin to load (a warning says so).
    `labelled` (default True): the dataset must have a label; a language model needs none.
    `real_valued` (default False): the label must be a float field (a regression target), not a
    class id; the reader then reads it as float32.
    `scaling_metric` (default "loss"): what a scaling study fits, "loss" (score's summed loss per
    count) or "error" (1 - hits / count, a classifier's).
    `unit` (default "example"): what score's count counts; a language model's is "token", and
    its scaling study's data axis is then training tokens.
    """

    metrics: dict[str, bool]
    headline: str

    def loss(self, outputs: Any, targets: Any) -> Any: ...

    def score(self, outputs: Any, targets: Any) -> tuple[Any, Any, int]: ...

    def evaluator(self, context: ObjectiveContext) -> Evaluator: ...


# What to change, for a method whose arguments changed since plugins were first written against it.
SIGNATURE_HINTS: dict[tuple[str, str], str] = {
    ("strategies", "__call__"): "take `hooks` after `options` and pass it to fit(..., hooks=hooks): it carries the "
    "run's checkpointer and live MLflow curves",
}

# Methods a kind may leave out, and the arguments flyscale passes when it is there.
OPTIONAL_METHODS: dict[str, dict[str, list[str]]] = {
    "datasets": {
        "row_schema": ["options"],
        "fingerprint": ["options"],
        "chunks": ["options"],
        "examples": ["options", "shard"],
        "shards": ["options"],
        "parts": ["options"],
        "part": ["options", "name"],
    },
    "strategies": {
        "check": ["model", "cfg", "options", "world_size"],
        # The older form: the strategy trains by itself (see StrategyPlugin).
        "__call__": ["model", "data", "cfg", "ctx", "options", "hooks"],
    },
    "gates": {"reads": ["options"]},
    "objectives": {
        "pair": ["x", "y"],
        "samples": ["model", "context"],
        "with_options": ["options"],
        "predict": ["model", "model_input", "params", "context"],
        "example": ["context"],
        "serving": ["context"],
    },
}

# A method the Protocol declares that a plugin may leave out when it has the other:
# {kind: {method: its alternative}}.
ALTERNATIVES: dict[str, dict[str, str]] = {
    "datasets": {"load": "examples"},  # typed examples come as Arrow batches instead of one frame
    "strategies": {"parallelize": "__call__"},  # the older form, that trains by itself
}

# Attributes every kind may declare, and their value when a plugin leaves them out.
OPTIONAL_ATTRIBUTES: dict[str, dict[str, Any]] = {
    "datasets": {"options_type": None, "default_augmentations": (), "streaming": False, "objective": "classification"},
    "models": {"options_type": None},
    "augmentations": {"options_type": None},
    "strategies": {"options_type": None, "traits": None},
    "quantizers": {"options_type": None, "calibrates": False, "works_on": "torch"},
    "gates": {"options_type": None, "compares_champion": False},
    "objectives": {
        "options_type": None,
        "labelled": True,
        "real_valued": False,
        "scaling_metric": "loss",
        "unit": "example",
    },
}

# An attribute that, when a plugin sets it true, needs an optional method: {kind: {attribute: method}}.
REQUIRED_WHEN: dict[str, dict[str, str]] = {
    "datasets": {"streaming": "chunks"},
}

# An attribute that, when a plugin sets it true, makes flyscale pass a method more arguments:
# {kind: {attribute: (method, [argument names])}}.
ARGUMENTS_WHEN: dict[str, dict[str, tuple[str, list[str]]]] = {
    "quantizers": {"calibrates": ("quantize", ["model", "options", "calibration"])},
}

PROTOCOLS: dict[str, type] = {
    "datasets": DatasetPlugin,
    "models": ModelPlugin,
    "augmentations": AugmentationPlugin,
    "strategies": StrategyPlugin,
    "quantizers": QuantizerPlugin,
    "gates": GatePlugin,
    "objectives": ObjectivePlugin,
}


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
    )
    defaults = {
        "label_column": "label",
        "feature_ranges": {},
        "feature_dtypes": {},
        "inferred": [],
        "fields": [],
        "input_field": "",
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
