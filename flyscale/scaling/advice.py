"""What to do next, computed from a study's measurements, each recommendation with the numbers
behind it: where more data or a bigger model stops paying (the knee), whether the model is
data- or capacity-bound, and how many workers pay (worker_count.py). Each recommendation sits
beside the numbers it rests on."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from flyscale.scaling.config import ScalingConfig
from flyscale.scaling.laws import (
    PowerLawFit,
    curve_noise,
    fit_power_law,
    sorted_curve,
)
from flyscale.scaling.plan import ScalingPoint, data_noun, on_axis, point_label, size_of
from flyscale.scaling.worker_count import WorkerAdvice, worker_advice


@dataclass
class Knee:
    """The smallest size on an axis whose val metric is within `tolerance` of the best."""

    axis: str
    found: bool
    sentence: str
    size: float = 0.0  # training rows (or tokens) or parameters
    value: float = 0.0  # its val metric (error or loss)
    best_size: float = 0.0
    best_value: float = 0.0
    tolerance: float = 0.0
    key: str = ""  # the point's key


def find_knee(points: list[ScalingPoint], axis: str, tolerance: float) -> Knee:
    """The knee of the `axis` curve: the smallest size within `tolerance` of the best val metric."""
    curve = on_axis(points, axis)
    if len(curve) < 2:
        return Knee(axis, False, f"{axis}: not swept (fewer than 2 sizes)")
    metric = curve[0].metric
    best = min(curve, key=lambda p: (p.val_metric, size_of(p, axis)))
    knee = min((p for p in curve if p.val_metric <= best.val_metric + tolerance), key=lambda p: size_of(p, axis))
    if knee is best:
        sentence = (
            f"{axis}: {point_label(knee, axis)} has the best val {metric} ({best.val_metric:.4f}); no smaller "
            f"size measured comes within {tolerance:.4f} of it"
        )
    else:
        sentence = (
            f"{axis}: {point_label(knee, axis)} is within {tolerance:.4f} of the best val {metric} "
            f"({knee.val_metric:.4f} against {best.val_metric:.4f} at {point_label(best, axis)})"
        )
    return Knee(
        axis,
        True,
        sentence,
        size_of(knee, axis),
        knee.val_metric,
        size_of(best, axis),
        best.val_metric,
        tolerance,
        knee.key,
    )


@dataclass
class Falling:
    """Whether the val metric still falls along an axis, and the numbers that say so."""

    axis: str
    measured: bool
    falling: bool
    gain: float  # what a doubling removes of the metric, from the fit or the last two sizes
    because: str


def still_falling(points: list[ScalingPoint], fit: PowerLawFit, axis: str, min_gain: float) -> Falling:
    """From the fit when it is meaningful, else from the last two sizes (per doubling), where a
    drop inside the validation set's sampling noise is not a drop."""
    curve = on_axis(points, axis)
    noun = "data" if axis == "data" else "parameters"
    metric = curve[0].metric if curve else "error"
    if fit.meaningful:
        falling = fit.drop >= min_gain
        return Falling(
            axis,
            True,
            falling,
            fit.drop,
            f"doubling the {noun} would lower val {metric} by about {fit.drop:.4f} (90% range "
            f"{fit.drop_low:.4f}-{fit.drop_high:.4f}), {'at least' if falling else 'under'} "
            f"scaling.min_gain {min_gain:.4f}",
        )
    sizes, values = [size_of(p, axis) for p in curve], [p.val_metric for p in curve]
    m, e = sorted_curve(sizes, values)
    if len(m) < 2:
        return Falling(axis, False, False, 0.0, f"{noun}: not swept")
    gain = (e[-2] - e[-1]) / math.log2(m[-1] / m[-2])
    sigma = curve_noise(sizes, values, [p.val_noise for p in curve], max(p.val_rows for p in curve))
    noise = 2 * math.hypot(sigma[-2], sigma[-1])
    falling = bool(gain >= min_gain and e[-2] - e[-1] > noise)  # a numpy bool would not cross a task boundary
    noise_note = f", against sampling noise of {noise:.4f}" if noise > 0 else ""
    return Falling(
        axis,
        True,
        falling,
        float(gain),
        f"from {m[-2]:,.0f} to {m[-1]:,.0f} {noun} val {metric} went {e[-2]:.4f} -> {e[-1]:.4f} "
        f"({gain:.4f} a doubling{noise_note}; no fit: {fit.reason})",
    )


@dataclass
class Bound:
    """Data-bound (collect or augment more data), capacity-bound (a bigger model), both or neither."""

    verdict: str
    advice: str
    reasons: list[str]
    data_falling: bool = False
    model_falling: bool = False
    gap: float = 0.0  # val minus train metric at the largest data point
    gap_large: bool = False


def bound(points: list[ScalingPoint], data: Falling, model: Falling, max_gap: float) -> Bound:
    """Data-bound when the val metric still falls with data or the train/val gap is large;
    capacity-bound when it still falls with parameters."""
    reasons = [
        f"data: {data.because}" if data.measured else "data: not swept",
        f"model: {model.because}" if model.measured else "model: not swept",
    ]
    largest = max(on_axis(points, "data") or points, key=lambda p: (size_of(p, "data"), -p.val_metric))
    gap = largest.gap
    gap_large = gap > max_gap
    reasons.append(
        f"train/val gap at {size_of(largest, 'data'):,.0f} {data_noun(largest.unit)}: {gap:.4f} "
        f"({'over' if gap_large else 'within'} scaling.max_gap {max_gap:.4f})"
    )
    data_bound, capacity_bound = (data.measured and data.falling) or gap_large, model.measured and model.falling
    if data_bound and capacity_bound:
        verdict, advice = "data- and capacity-bound", "both more data and a bigger model still pay"
    elif data_bound:
        verdict, advice = "data-bound", "collect or augment more data"
    elif capacity_bound:
        verdict, advice = "capacity-bound", "use a bigger model"
    elif not (data.measured or model.measured):
        verdict, advice = "not measured", "sweep scaling.data_fractions or the model multipliers"
    else:
        verdict, advice = "neither", "more data or parameters no longer pay; look elsewhere (the recipe, the labels)"
    return Bound(verdict, advice, reasons, data.falling, model.falling, gap, gap_large)


@dataclass
class StudyResult:
    """Every measurement of a study, the fits, and the recommendations drawn from them."""

    points: list[ScalingPoint]
    data_fit: PowerLawFit
    model_fit: PowerLawFit
    data_knee: Knee
    model_knee: Knee
    bound: Bound
    workers: WorkerAdvice

    @property
    def metric(self) -> str:
        """What the study fitted: "error" (a classifier's) or "loss"."""
        return self.points[0].metric if self.points else "error"

    @property
    def data_noun(self) -> str:
        """What the data axis counts: "training rows", or "training tokens"."""
        return data_noun(self.points[0].unit if self.points else "example")

    def lines(self) -> list[str]:
        """The fits and recommendations as sentences, each with its numbers."""
        return [
            self.data_fit.summary(),
            self.model_fit.summary(),
            self.data_knee.sentence,
            self.model_knee.sentence,
            f"bound: {self.bound.verdict}: {self.bound.advice} ({'; '.join(self.bound.reasons)})",
            self.workers.sentence,
        ]


def analyse(points: list[ScalingPoint], cfg: ScalingConfig) -> StudyResult:
    """Fits, knees, the data/capacity verdict and the worker count, from the measured points."""
    val_rows = max((p.val_rows for p in points), default=0)
    metric, unit = (points[0].metric, points[0].unit) if points else ("error", "example")
    fits = {}
    for axis, fit_axis in (("data", "data"), ("model", "parameters")):
        curve = on_axis(points, axis)
        fits[axis] = fit_power_law(
            [size_of(p, axis) for p in curve],
            [p.val_metric for p in curve],
            fit_axis,
            val_rows,
            cfg.min_gain,
            cfg.seed,
            noise=[p.val_noise for p in curve],
            metric=metric,
            noun=data_noun(unit),
        )
    data = still_falling(points, fits["data"], "data", cfg.min_gain)
    model = still_falling(points, fits["model"], "model", cfg.min_gain)
    return StudyResult(
        points=points,
        data_fit=fits["data"],
        model_fit=fits["model"],
        data_knee=find_knee(points, "data", cfg.tolerance),
        model_knee=find_knee(points, "model", cfg.tolerance),
        bound=bound(points, data, model, cfg.max_gap),
        workers=worker_advice(points, cfg.min_efficiency),
    )


@dataclass
class StudySummary:
    """What a study measured and recommends, and where it went: the workflow's output."""

    result: StudyResult
    tracking_uri: str = ""
    experiment_id: str = ""
    parent_run_id: str = ""  # the MLflow run every point is a child of
    trained: list[str] = field(default_factory=list)  # points trained by this execution
    cached: list[str] = field(default_factory=list)  # points served from the cache

    def __str__(self) -> str:
        r = self.result
        lines = [
            "",
            "flyscale scaling study",
            f"  points      {len(r.points)} training runs; trained now: {len(self.trained)}, from the cache: "
            f"{len(self.cached)}",
        ]
        for p in sorted(r.points, key=lambda p: p.key):
            tokens = f" {p.train_units:>10,} {p.unit}s" if p.unit != "example" else ""
            lines.append(
                f"  point       {p.key:<34} {p.train_rows:>7,} rows{tokens} {p.parameters:>9,} params  "
                f"val {p.metric} {p.val_metric:.4f} (+-{p.val_noise:.4f})  train {p.metric} {p.train_metric:.4f}  "
                f"gap {p.gap:+.4f}  {p.samples_per_s:>8,.0f} samples/s "
                f"({p.samples_per_s_low:,.0f}-{p.samples_per_s_high:,.0f})"
            )
        lines += [
            f"  fit         {r.data_fit.summary()}",
            f"  fit         {r.model_fit.summary()}",
            f"  knee        {r.data_knee.sentence}",
            f"  knee        {r.model_knee.sentence}",
            f"  bound       {r.bound.verdict}: {r.bound.advice}",
        ]
        lines += [f"              {reason}" for reason in r.bound.reasons]
        lines.append(f"  {r.workers.sentence.replace('workers: ', 'workers     ', 1)}")
        if self.parent_run_id:
            lines.append(
                f"  mlflow      parent run {self.parent_run_id} (experiment {self.experiment_id}) at "
                f"{self.tracking_uri}: one child run per point"
            )
        return "\n".join(lines)
