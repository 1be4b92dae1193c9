"""The runs of a study and what each measured: one axis at a time around the base point (all
the training rows, the base model, `base_workers` workers).

- data: nested fractions of the training split (each smaller set inside the larger);
- model: width and depth multipliers, through options the model plugin declares;
- workers: worker counts, for throughput, speed-up and parallel efficiency."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields

import numpy as np

from flyscale.config import ModelConfig
from flyscale.scaling.config import DEPTH, WIDTH, ScalingConfig, point_model
from flyscale.train.telemetry import steady


@dataclass
class PointSpec:
    """One training run of a study."""

    key: str
    axes: list[str]  # the curves it belongs to: "data", "model", "workers" (the base point: all swept)
    data_fraction: float = 1.0
    width_multiplier: float = 1.0
    depth_multiplier: float = 1.0
    workers: int = 1


def plan(cfg: ScalingConfig) -> list[PointSpec]:
    """Every run of the study, each once, the base point included (one axis at a time)."""
    found: dict[tuple[float, float, float, int], list[str]] = {}
    base_n = cfg.base_workers
    if cfg.data_fractions:
        for f in sorted({1.0, *cfg.data_fractions}):
            found.setdefault((f, 1.0, 1.0, base_n), []).append("data")
    if cfg.width_multipliers or cfg.depth_multipliers:
        sizes = [(w, 1.0) for w in sorted({1.0, *cfg.width_multipliers})]
        sizes += [(1.0, d) for d in sorted({1.0, *cfg.depth_multipliers}) if d != 1.0]
        for w, d in sizes:
            found.setdefault((1.0, w, d, base_n), []).append("model")
    if cfg.workers:
        for n in sorted({base_n, *cfg.workers}):
            found.setdefault((1.0, 1.0, 1.0, n), []).append("workers")
    return [
        PointSpec(f"data{f:g}-width{w:g}-depth{d:g}-workers{n}", axes, f, w, d, n)
        for (f, w, d, n), axes in found.items()
    ]


def nested_subset(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Row indices of a stratified `fraction` of the rows: per class a prefix of one seeded
    permutation, so each fraction's rows contain every smaller fraction's (the data axis then
    measures more data, not other data). Every class keeps at least one row."""
    rng = np.random.default_rng(seed)
    keep = []
    for label in np.unique(labels):  # sorted, so the permutations do not depend on the fraction
        rows = rng.permutation(np.flatnonzero(labels == label))
        keep.append(rows[: max(1, math.floor(fraction * len(rows) + 0.5))])
    return np.sort(np.concatenate(keep))


@dataclass
class ScalingPoint:
    """What one run measured."""

    key: str
    axes: list[str]
    data_fraction: float
    width_multiplier: float
    depth_multiplier: float
    workers: int
    train_rows: int  # the training rows it learned from, before augmentation
    parameters: int
    # The study's metric (flyscale/scaling/measure.py), in eval mode: "error" (1 - accuracy, a
    # classifier's) or "loss" (per counted target: a language model's nats per token).
    val_metric: float
    train_metric: float  # on its own (unaugmented) training rows
    metric: str = "error"
    val_noise: float = 0.0  # the standard error of val_metric (0: unknown)
    val_rows: int = 0
    unit: str = "example"  # what the objective counts: "example", or "token"
    train_units: int = 0  # the units its training rows hold: its size on the data axis (0: its rows)
    samples_per_s: float = 0.0  # training throughput over every worker: median of the epochs after the first
    samples_per_s_low: float = 0.0  # the quartiles of those epochs: how steady the measurement was
    samples_per_s_high: float = 0.0
    train_seconds: float = 0.0
    epochs: int = 0
    mlflow_run_id: str = ""  # the run training logged its live curves to
    trained_at: float = 0.0  # when its training ran (before this execution: from the cache)
    # What its training said held it back (telemetry.diagnose_epochs), from the same steady epochs
    # as samples_per_s: the worker advice answers it rather than contradicting it.
    diagnosis: str = ""

    def __post_init__(self):
        # Measurements arrive as numpy scalars as often as not; a task boundary takes Python's only.
        for f in fields(self):
            if f.type in ("int", "float"):
                setattr(self, f.name, (int if f.type == "int" else float)(getattr(self, f.name)))

    @property
    def gap(self) -> float:
        """Val minus train metric: over-fitting (for error, train minus val accuracy)."""
        return self.val_metric - self.train_metric


def throughput(samples_per_s: list[float]) -> tuple[float, float, float]:
    """Training throughput of a run: the median epoch after the first (which pays for warm-up),
    and the quartiles of those epochs; the same epochs the training's diagnosis rests on."""
    return steady(samples_per_s)


def on_axis(points: list[ScalingPoint], axis: str) -> list[ScalingPoint]:
    return [p for p in points if axis in p.axes]


def size_of(p: ScalingPoint, axis: str) -> float:
    """A point's size on an axis: its training rows or tokens (data), or its parameters (model)."""
    if axis == "data":
        return float(p.train_units or p.train_rows)
    return float(p.parameters)


def data_noun(unit: str) -> str:
    """What the data axis counts: "training rows", or "training tokens" for a language model."""
    return "training rows" if unit == "example" else f"training {unit}s"


def point_label(p: ScalingPoint, axis: str) -> str:
    if axis == "data":
        rows = f", {p.train_rows:,} rows" if p.unit != "example" else ""
        return f"{size_of(p, axis):,.0f} {data_noun(p.unit)} (fraction {p.data_fraction:g}{rows})"
    return f"{p.parameters:,} parameters (width x{p.width_multiplier:g}, depth x{p.depth_multiplier:g})"


def replace_point(spec: PointSpec, **measured) -> ScalingPoint:
    """A ScalingPoint from its spec and what was measured."""
    return ScalingPoint(**{**dataclasses.asdict(spec), **measured})


def spec_model(base: ModelConfig, spec: PointSpec) -> ModelConfig:
    """The model of a point: the base model, with only the multipliers the point changes."""
    model = base
    if spec.width_multiplier != 1.0:
        model = point_model(model, WIDTH, spec.width_multiplier)
    if spec.depth_multiplier != 1.0:
        model = point_model(model, DEPTH, spec.depth_multiplier)
    return model
