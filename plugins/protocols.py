"""What each kind of plugin provides. Structural typing: a plugin need not import flyscale.

A plugin is any object with these attributes, registered under an entry point, e.g. in the
plugin package's pyproject.toml:

    [project.entry-points."flyscale.models"]
    acme_resnet = "acme_flyscale.models:AcmeResNet"   # an instance or a class with no-arg __init__
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

import numpy as np
import pandas as pd
from torch import nn


@dataclass
class DatasetInfo:
    """Shape facts the model builder and evaluation need; travels between tasks."""

    name: str
    num_classes: int
    input_shape: list[int]  # per-example shape, e.g. [1, 8, 8]; features are stored flattened
    feature_columns: list[str]
    label_column: str = "label"


@runtime_checkable
class DatasetPlugin(Protocol):
    """A source of labelled rows: one `label` column plus numeric feature columns."""

    options_type: type | None  # dataclass of the plugin's options, or None

    def load(self, options: Any) -> pd.DataFrame: ...

    def info(self, options: Any) -> DatasetInfo: ...

    def row_schema(self, options: Any):
        """A pandera DataFrameSchema whose row-level failures send rows to quarantine."""
        ...


@runtime_checkable
class ModelPlugin(Protocol):
    """Builds a fresh model. Return an `nn.Sequential` so pipeline parallelism can split it."""

    options_type: type | None

    def build(self, options: Any, info: DatasetInfo) -> nn.Module: ...


@runtime_checkable
class AugmentationPlugin(Protocol):
    """Transforms a batch of examples, shape (N, *input_shape), deterministically given `rng`."""

    options_type: type | None

    def __call__(self, x: np.ndarray, rng: np.random.Generator, options: Any) -> np.ndarray: ...


@runtime_checkable
class QuantizerPlugin(Protocol):
    """Returns a quantized copy of a trained float model (the input is left untouched)."""

    options_type: type | None

    def quantize(self, model: nn.Module, options: Any) -> nn.Module: ...


@dataclass
class GateVerdict:
    """A gate's decision, with the reason a person reads in the summary and in MLflow."""

    name: str
    passed: bool
    reason: str


@runtime_checkable
class GatePlugin(Protocol):
    """Decides whether a candidate's metrics are good enough to publish."""

    options_type: type | None

    def check(
        self, metrics: Mapping[str, float], options: Any, champion: Mapping[str, float] | None
    ) -> GateVerdict: ...


# A training strategy is a function `(model, data, cfg, ctx, options) -> TrainResult`; see
# flyscale/training.py for `TrainData` and `TrainResult`. Optional attributes: `options_type`, and
# `per_worker_batch` (default True: `train.batch_size` rows per worker, as in data parallelism;
# False when every worker sees the same global batch of `train.batch_size`, as in pipelining).
StrategyFn = Callable[..., Any]


def parse_options(plugin: Any, options: Mapping[str, Any] | None, where: str) -> Any:
    """Turn a config mapping into the plugin's own options dataclass; errors name the field."""
    options = dict(options or {})
    opt_type = getattr(plugin, "options_type", None)
    if opt_type is None:
        if options:
            raise ValueError(f"{where}: this plugin takes no options, got {sorted(options)}")
        return None
    from dataclasses import fields

    known = {f.name for f in fields(opt_type)}
    for key in options:
        if key not in known:
            raise ValueError(f"{where}.{key}: unknown option; expected one of {', '.join(sorted(known)) or '(none)'}")
    try:
        return opt_type(**options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from exc

