"""Scaling studies: which runs to make, the power law their errors follow, and what to do next.

A study trains the base config at several sizes along up to three axes, one axis at a time
around the base point (all the training rows, the base model, `base_workers` workers):

- data: nested fractions of the training split (each smaller set inside the larger);
- model: width and depth multipliers, through options the model plugin declares;
- workers: worker counts, for throughput, speed-up and parallel efficiency.

This module is the pure part: the plan, the fits of error(m) = alpha * m**beta + gamma
(Hestness et al. 2017, "Deep learning scaling is predictable, empirically") to validation error
against training rows and against parameter count, and recommendations computed from the
measurements, each with the numbers behind it. No Flyte and no MLflow: tasks/scaling.py adapts it.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field, fields

import numpy as np

from flyscale.config import ModelConfig, PipelineConfig, _fraction, _Section

WIDTH, DEPTH = "width_multiplier", "depth_multiplier"  # the model options a plugin declares to be swept
# alpha, beta and gamma are three parameters: a fourth point is the least that leaves a residual,
# so the least that can show the form does NOT fit. Three points are always fitted exactly.
MIN_FIT_POINTS = 4
MIN_R2 = 0.5  # in log space; below this the points do not follow the form, whatever it would extrapolate
# Steeper than m^-4 is a step between two sizes, not a power law (published learning curves fall
# far slower; digits' MLP falls about as m^-1 with data).
BETA_BOUND = -4.0
INTERVAL = (5.0, 95.0)  # percentiles of the bootstrapped extrapolation: a 90% range
BOOTSTRAP = 200


@dataclass
class ScalingConfig(_Section):
    """What a study sweeps, and the thresholds its recommendations are judged by.

    The base point (every training row, multipliers 1, `base_workers`) is on every axis whether
    listed or not. An empty list leaves that axis out.
    """

    _section = "scaling"
    data_fractions: list[float] = field(default_factory=lambda: [0.125, 0.25, 0.5, 1.0])
    width_multipliers: list[float] = field(default_factory=lambda: [0.25, 0.5, 1.0])
    depth_multipliers: list[float] = field(default_factory=list)
    workers: list[int] = field(default_factory=lambda: [1, 2])
    base_workers: int = 1  # the worker count of the data and model points
    # Every worker gets the same share, so n workers have n times the resources of one (as on a
    # cluster, where each has its own GPU) and efficiency measures the parallelism, not contention
    # for cores: 2 threads on a 2-core machine shared with anything else ran ~8x slower, in bursts.
    threads_per_worker: int = 1
    seed: int = 0  # the permutation whose prefixes are the nested subsets
    tolerance: float = 0.01  # the knee: the smallest size whose val error is within this of the best
    min_gain: float = 0.005  # a doubling that lowers val error by less than this no longer pays
    max_gap: float = 0.05  # train minus val accuracy above this is over-fitting: more data helps
    min_efficiency: float = 0.7  # parallel efficiency under this: that many workers do not pay
    experiment: str = "flyscale-scaling"  # the MLflow experiment of the parent run and its points

    def __post_init__(self):
        for name in ("data_fractions", "width_multipliers", "depth_multipliers", "workers"):
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"scaling.{name} lists a value twice: {values}")
        if any(not 0.0 < f <= 1.0 for f in self.data_fractions):
            raise ValueError(f"scaling.data_fractions must each be in (0, 1], got {self.data_fractions}")
        for name in ("width_multipliers", "depth_multipliers"):
            if any(m <= 0 for m in getattr(self, name)):
                raise ValueError(f"scaling.{name} must each be > 0 (1 = the base model), got {getattr(self, name)}")
        if any(n < 1 for n in self.workers) or self.base_workers < 1 or self.threads_per_worker < 1:
            raise ValueError(f"scaling.workers, scaling.base_workers and scaling.threads_per_worker must be >= 1, "
                             f"got {self.workers}, {self.base_workers} and {self.threads_per_worker}")
        if not (self.data_fractions or self.width_multipliers or self.depth_multipliers or self.workers):
            raise ValueError("scaling: nothing to sweep; list scaling.data_fractions, scaling.width_multipliers, "
                             "scaling.depth_multipliers or scaling.workers")
        for name in ("tolerance", "min_gain", "max_gap"):
            _fraction(self, name)
        _fraction(self, "min_efficiency", lo=0.01)
        if not self.experiment.strip():
            raise ValueError("scaling.experiment must not be empty")


@dataclass
class StudyConfig(PipelineConfig):
    """A pipeline config, which is the study's base point, and the sweep around it: a preset is
    any pipeline preset plus a `scaling:` section."""

    scaling: ScalingConfig = field(default_factory=ScalingConfig)

    def __post_init__(self):
        super().__post_init__()
        if self.data.plugin.attribute("streaming"):
            raise ValueError(f"data.dataset: {self.data.dataset!r} streams data larger than memory, and a scaling "
                             f"study subsets the training split in memory; use its in-memory twin")
        for name, option in (("width_multipliers", WIDTH), ("depth_multipliers", DEPTH)):
            for value in getattr(self.scaling, name):
                point_model(self.model, option, value, f"scaling.{name}")  # an unbuildable size fails now


def point_model(base: ModelConfig, option: str, multiplier: float, where: str = "") -> ModelConfig:
    """The base model config with `option` (width or depth multiplier) times `multiplier`."""
    declared = [f.name for f in fields(base.plugin.options)] if base.plugin.options is not None else []
    if option not in declared:
        raise ValueError(f"{where or option}: model {base.name!r} declares no {option} option (its options: "
                         f"{', '.join(declared) or 'none'}); sweep a model whose plugin declares one, e.g. mlp or cnn")
    value = getattr(base.plugin.options, option) * multiplier
    try:
        return ModelConfig(name=base.name, options={**base.options, option: value})
    except ValueError as exc:
        raise ValueError(f"{where or option}: multiplier {multiplier:g} gives an unusable model: {exc}") from None


# ---------------------------------------------------------------------------------------------
# The plan and the measurements


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
    return [PointSpec(f"data{f:g}-width{w:g}-depth{d:g}-workers{n}", axes, f, w, d, n)
            for (f, w, d, n), axes in found.items()]


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
    val_error: float  # 1 - validation accuracy, in eval mode
    train_error: float  # 1 - accuracy on its own (unaugmented) training rows, in eval mode
    val_rows: int = 0  # sets the sampling noise of val_error (0: unknown)
    samples_per_s: float = 0.0  # training throughput over every worker: median of the epochs after the first
    samples_per_s_low: float = 0.0  # the quartiles of those epochs: how steady the measurement was
    samples_per_s_high: float = 0.0
    train_seconds: float = 0.0
    epochs: int = 0
    mlflow_run_id: str = ""  # the run training logged its live curves to
    trained_at: float = 0.0  # when its training ran (before this execution: from the cache)

    def __post_init__(self):
        # Measurements arrive as numpy scalars as often as not; a task boundary takes Python's only.
        for f in fields(self):
            if f.type in ("int", "float"):
                setattr(self, f.name, (int if f.type == "int" else float)(getattr(self, f.name)))

    @property
    def gap(self) -> float:
        """Train minus validation accuracy: over-fitting."""
        return self.val_error - self.train_error


def throughput(samples_per_s: list[float]) -> tuple[float, float, float]:
    """Training throughput of a run: the median epoch after the first (which pays for warm-up),
    and the quartiles of those epochs."""
    steady = samples_per_s[1:] or samples_per_s
    if not steady:
        return 0.0, 0.0, 0.0
    low, median, high = np.percentile(steady, [25, 50, 75])
    return float(median), float(low), float(high)


def on_axis(points: list[ScalingPoint], axis: str) -> list[ScalingPoint]:
    return [p for p in points if axis in p.axes]


def _noise(error: float, rows: int) -> float:
    """The binomial standard error of an error rate measured on `rows` rows (0 when unknown)."""
    return math.sqrt(max(error * (1 - error), 0.0) / rows) if rows > 0 else 0.0


# ---------------------------------------------------------------------------------------------
# Fits


@dataclass
class PowerLawFit:
    """error(m) = alpha * m**beta + gamma fitted to val error against `axis`, or why not."""

    axis: str  # "data" (m: training rows) or "parameters" (m: parameter count)
    meaningful: bool
    reason: str  # why there is no fit ("" when there is one)
    points: int
    alpha: float = 0.0
    beta: float = 0.0
    gamma: float = 0.0  # the irreducible error: what no amount of m removes
    r2_log: float = 0.0  # of log(error), so small errors count as much as large ones
    rmse_log: float = 0.0
    largest: float = 0.0  # the largest m measured, where the extrapolation starts
    drop: float = 0.0  # predicted error at `largest` minus at twice `largest`
    drop_low: float = 0.0  # the 90% range of `drop`, from a parametric bootstrap of the fit
    drop_high: float = 0.0

    def predict(self, m: np.ndarray | float) -> np.ndarray:
        return self.alpha * np.asarray(m, dtype=float) ** self.beta + self.gamma

    def summary(self) -> str:
        noun = "training rows" if self.axis == "data" else "parameters"
        if not self.meaningful:
            return f"error vs {noun}: no fit ({self.reason})"
        return (f"error vs {noun}: {self.alpha:.3g} * m^{self.beta:.3f} + {self.gamma:.4f} (beta {self.beta:.3f}, "
                f"irreducible error gamma {self.gamma:.4f}); R^2 {self.r2_log:.3f} and RMSE {self.rmse_log:.3f} in "
                f"log space over {self.points} points. Doubling the {noun} ({self.largest:,.0f} -> "
                f"{2 * self.largest:,.0f}) would lower error by about {self.drop:.4f} (90% range "
                f"{self.drop_low:.4f}-{self.drop_high:.4f})")


def _curve(sizes: list[float], errors: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct sizes and the mean error at each."""
    m = np.asarray(sizes, dtype=float)
    e = np.asarray(errors, dtype=float)
    distinct = np.unique(m)
    return distinct, np.array([e[m == s].mean() for s in distinct])


def trend(m: np.ndarray, e: np.ndarray, val_rows: int, min_gain: float) -> str:
    """Why the curve has no power-law region, or "" when it falls. Changes under the larger of
    `min_gain` and twice the validation set's sampling noise are not changes."""
    def threshold(a: float, b: float) -> float:
        return max(min_gain, 2 * math.hypot(_noise(a, val_rows), _noise(b, val_rows)))

    lowest = int(np.argmin(e))
    if e[-1] - e[lowest] > threshold(e[-1], e[lowest]):
        where = "with size" if lowest == 0 else f"after {m[lowest]:,.0f}"
        return (f"no power-law region: error rises {where} ({e[lowest]:.4f} at {m[lowest]:,.0f}, {e[-1]:.4f} at "
                f"{m[-1]:,.0f}); more of it is making the model worse")
    if e[0] - e[-1] <= threshold(e[0], e[-1]):
        return (f"no power-law region: error is flat ({e[0]:.4f} at {m[0]:,.0f}, {e[-1]:.4f} at {m[-1]:,.0f}, "
                f"a change under {threshold(e[0], e[-1]):.4f}); the curve is at its floor or in the noise")
    return ""


def _log_model(x: np.ndarray, a: float, b: float, g: float) -> np.ndarray:
    return np.log(np.exp(a) * x**b + g)


def _log_model_jacobian(x: np.ndarray, a: float, b: float, g: float) -> np.ndarray:
    # Analytic: a third faster than finite differences, and the bootstrap fits 200 times.
    power = np.exp(a) * x**b
    total = power + g
    return np.stack([power / total, power * np.log(x) / total, 1 / total], axis=1)


def _fit_once(x: np.ndarray, y: np.ndarray, starts: list[tuple[float, float, float]], g_max: float):
    """The best least-squares (a, b, g) in log space over the starts, or None if none converged."""
    from scipy.optimize import curve_fit

    best, best_sse = None, math.inf
    for p0 in starts:
        p0 = (p0[0], min(max(p0[1], BETA_BOUND + 0.01), -1e-3), min(max(p0[2], 0.0), g_max * 0.999))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                p, _ = curve_fit(_log_model, x, y, p0=p0, bounds=([-30, BETA_BOUND, 0.0], [30, 0.0, g_max]),
                                 maxfev=5000, jac=_log_model_jacobian)
        except (RuntimeError, ValueError):
            continue
        sse = float(np.sum((_log_model(x, *p) - y) ** 2))
        if sse < best_sse:
            best, best_sse = p, sse
    return best


def _starts(x: np.ndarray, e: np.ndarray) -> list[tuple[float, float, float]]:
    """Starting points: gamma at a few shares of the lowest error, alpha and beta from a line in log-log."""
    out = []
    for share in (0.0, 0.3, 0.6, 0.9):
        g = share * e.min()
        slope, intercept = np.polyfit(np.log(x), np.log(np.maximum(e - g, 1e-12)), 1)
        out.append((float(intercept), float(slope), g))
    return out


def fit_power_law(sizes: list[float], errors: list[float], axis: str, val_rows: int = 0, min_gain: float = 0.005,
                  seed: int = 0) -> PowerLawFit:
    """Fit error(m) = alpha * m**beta + gamma, or say why a fit would mean nothing."""
    m, e = _curve(sizes, errors)
    n = len(m)
    if n < MIN_FIT_POINTS:
        return PowerLawFit(axis, False, f"{n} distinct sizes measured; fitting alpha, beta and gamma needs at least "
                                        f"{MIN_FIT_POINTS}, one more than the form's 3 parameters, to judge it by", n)
    why = trend(m, e, val_rows, min_gain)
    if why:
        return PowerLawFit(axis, False, why, n)
    # A zero error has no logarithm: floor it at half a validation row (or 1e-4 when unknown).
    e = np.maximum(e, 0.5 / val_rows if val_rows else 1e-4)
    x, y = m / m[-1], np.log(e)  # sizes relative to the largest, for conditioning
    g_max = float(e.min()) * (1 - 1e-9)
    p = _fit_once(x, y, _starts(x, e), g_max)
    if p is None:
        return PowerLawFit(axis, False, "the least-squares fit did not converge", n)
    resid = _log_model(x, *p) - y
    sst = float(np.sum((y - y.mean()) ** 2))
    r2 = 1 - float(np.sum(resid**2)) / sst if sst > 0 else 0.0
    rmse = float(np.sqrt(np.mean(resid**2)))
    if p[1] <= BETA_BOUND + 1e-3:
        gap = int(np.argmax(-np.diff(np.log(e))))  # the steepest step between neighbouring sizes
        return PowerLawFit(axis, False, f"error falls as a cliff, not a power law (beta reached its bound "
                                        f"{BETA_BOUND:g}): most of the drop is between {m[gap]:,.0f} and "
                                        f"{m[gap + 1]:,.0f}; measure sizes in between", n, r2_log=r2, rmse_log=rmse)
    if r2 < MIN_R2:
        return PowerLawFit(axis, False, f"the points do not follow a power law (R^2 {r2:.2f} in log space, under "
                                        f"{MIN_R2})", n, r2_log=r2, rmse_log=rmse)
    a, b, g = (float(v) for v in p)
    low, high = _bootstrap_drop(x, p, resid, e, val_rows, seed)
    return PowerLawFit(
        axis, True, "", n, alpha=float(math.exp(a) * m[-1] ** -b), beta=b, gamma=g, r2_log=r2, rmse_log=rmse,
        largest=float(m[-1]), drop=math.exp(a) * (1 - 2**b), drop_low=low, drop_high=high,
    )


def _bootstrap_drop(x, p, resid, e, val_rows: int, seed: int) -> tuple[float, float]:
    """The 90% range of the doubling's drop, by a parametric bootstrap: refit to the fitted curve
    plus noise, and take the drop of each refit.

    The noise is the residuals' scale, itself uncertain: with n - 3 degrees of freedom each
    replicate draws it as s * sqrt(dof / chi2(dof)) (with 4 points, dof = 1, this is what keeps
    the range honest; a fixed s covered the true drop 77% of the time, not 90%). It is never under
    the validation set's sampling noise. Few points, or noisy ones, make the range wide.
    """
    rng = np.random.default_rng(seed)
    dof = max(len(x) - 3, 1)
    s = math.sqrt(float(np.sum(resid**2)) / dof)
    floor = np.array([_noise(v, val_rows) / v for v in e])
    fitted = _log_model(x, *p)
    drops = []
    for _ in range(BOOTSTRAP):
        sigma = np.maximum(s * math.sqrt(dof / rng.chisquare(dof)), floor)
        y = fitted + rng.normal(0.0, sigma)
        q = _fit_once(x, y, [tuple(p)], float(np.exp(y).min()) * (1 - 1e-9))
        if q is not None:
            drops.append(math.exp(q[0]) * (1 - 2 ** q[1]))
    if not drops:
        return 0.0, 0.0
    low, high = np.percentile(drops, INTERVAL)
    return float(low), float(high)


# ---------------------------------------------------------------------------------------------
# Recommendations


@dataclass
class Knee:
    """The smallest size on an axis whose val error is within `tolerance` of the best."""

    axis: str
    found: bool
    sentence: str
    size: float = 0.0  # training rows or parameters
    error: float = 0.0
    best_size: float = 0.0
    best_error: float = 0.0
    tolerance: float = 0.0
    key: str = ""  # the point's key


def size_of(p: ScalingPoint, axis: str) -> float:
    """A point's size on an axis: its training rows (data) or its parameters (model)."""
    return float(p.train_rows if axis == "data" else p.parameters)


def _label(p: ScalingPoint, axis: str) -> str:
    if axis == "data":
        return f"{p.train_rows:,} training rows (fraction {p.data_fraction:g})"
    return f"{p.parameters:,} parameters (width x{p.width_multiplier:g}, depth x{p.depth_multiplier:g})"


def find_knee(points: list[ScalingPoint], axis: str, tolerance: float) -> Knee:
    """The knee of the `axis` curve: the smallest size within `tolerance` of the best val error."""
    curve = on_axis(points, axis)
    if len(curve) < 2:
        return Knee(axis, False, f"{axis}: not swept (fewer than 2 sizes)")
    best = min(curve, key=lambda p: (p.val_error, size_of(p, axis)))
    knee = min((p for p in curve if p.val_error <= best.val_error + tolerance), key=lambda p: size_of(p, axis))
    if knee is best:
        sentence = (f"{axis}: {_label(knee, axis)} has the best val error ({best.val_error:.4f}); no smaller size "
                    f"measured comes within {tolerance:.4f} of it")
    else:
        sentence = (f"{axis}: {_label(knee, axis)} is within {tolerance:.4f} of the best val error "
                    f"({knee.val_error:.4f} against {best.val_error:.4f} at {_label(best, axis)})")
    return Knee(axis, True, sentence, size_of(knee, axis), knee.val_error, size_of(best, axis), best.val_error,
                tolerance, knee.key)


@dataclass
class Falling:
    """Whether val error still falls along an axis, and the numbers that say so."""

    axis: str
    measured: bool
    falling: bool
    gain: float  # the error a doubling removes, from the fit or the last two sizes
    because: str


def still_falling(points: list[ScalingPoint], fit: PowerLawFit, axis: str, min_gain: float) -> Falling:
    """From the fit when it is meaningful, else from the last two sizes (per doubling), where a
    drop inside the validation set's sampling noise is not a drop."""
    curve = on_axis(points, axis)
    noun = "data" if axis == "data" else "parameters"
    if fit.meaningful:
        falling = fit.drop >= min_gain
        return Falling(axis, True, falling, fit.drop,
                       f"doubling the {noun} would lower val error by about {fit.drop:.4f} (90% range "
                       f"{fit.drop_low:.4f}-{fit.drop_high:.4f}), {'at least' if falling else 'under'} "
                       f"scaling.min_gain {min_gain:.4f}")
    m, e = _curve([size_of(p, axis) for p in curve], [p.val_error for p in curve])
    if len(m) < 2:
        return Falling(axis, False, False, 0.0, f"{noun}: not swept")
    gain = (e[-2] - e[-1]) / math.log2(m[-1] / m[-2])
    rows = max((p.val_rows for p in curve), default=0)
    noise = 2 * math.hypot(_noise(e[-2], rows), _noise(e[-1], rows))
    falling = bool(gain >= min_gain and e[-2] - e[-1] > noise)  # a numpy bool would not cross a task boundary
    noise_note = f", against sampling noise of {noise:.4f}" if rows else ""
    return Falling(axis, True, falling, float(gain),
                   f"from {m[-2]:,.0f} to {m[-1]:,.0f} {noun} val error went {e[-2]:.4f} -> {e[-1]:.4f} "
                   f"({gain:.4f} a doubling{noise_note}; no fit: {fit.reason})")


@dataclass
class Bound:
    """Data-bound (collect or augment more data), capacity-bound (a bigger model), both or neither."""

    verdict: str
    advice: str
    reasons: list[str]
    data_falling: bool = False
    model_falling: bool = False
    gap: float = 0.0  # train minus val accuracy at the largest data point
    gap_large: bool = False


def bound(points: list[ScalingPoint], data: Falling, model: Falling, max_gap: float) -> Bound:
    """Data-bound when error still falls with data or the train/val gap is large; capacity-bound
    when it still falls with parameters."""
    reasons = [f"data: {data.because}" if data.measured else "data: not swept",
               f"model: {model.because}" if model.measured else "model: not swept"]
    largest = max(on_axis(points, "data") or points, key=lambda p: (p.train_rows, -p.val_error))
    gap = largest.gap
    gap_large = gap > max_gap
    reasons.append(f"train/val gap at {largest.train_rows:,} rows: {gap:.4f} "
                   f"({'over' if gap_large else 'within'} scaling.max_gap {max_gap:.4f})")
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
class Efficiency:
    workers: int
    samples_per_s: float
    speedup: float  # throughput against the fewest workers measured
    efficiency: float  # speed-up per added worker: speedup * fewest / workers
    low: float = 0.0  # the efficiency the epochs' throughput quartiles allow, at worst and at best
    high: float = 0.0


@dataclass
class WorkerAdvice:
    """The worker count beyond which parallel efficiency falls under the threshold."""

    measured: bool
    workers: int
    sentence: str
    threshold: float = 0.0
    table: list[Efficiency] = field(default_factory=list)


def worker_advice(points: list[ScalingPoint], min_efficiency: float) -> WorkerAdvice:
    """From measured throughput only: the largest count up to which every count keeps at least
    `min_efficiency` of linear scaling, against the fewest workers measured. Each efficiency comes
    with the range its epochs' throughput quartiles allow; a range across the threshold is said."""
    by_count: dict[int, list[ScalingPoint]] = {}
    for p in on_axis(points, "workers"):
        by_count.setdefault(p.workers, []).append(p)
    if len(by_count) < 2:
        return WorkerAdvice(False, 0, "workers: not swept (fewer than 2 worker counts)")
    counts = sorted(by_count)
    speed = {n: float(np.median([p.samples_per_s for p in by_count[n]])) for n in counts}
    # Unknown quartiles (0) are the median itself: no spread claimed that was not measured.
    low = {n: min(p.samples_per_s_low or p.samples_per_s for p in by_count[n]) for n in counts}
    high = {n: max(p.samples_per_s_high or p.samples_per_s for p in by_count[n]) for n in counts}
    n0 = counts[0]
    if speed[n0] <= 0 or low[n0] <= 0:
        return WorkerAdvice(False, 0, f"workers: no throughput was measured at {n0} worker(s)")
    table = [Efficiency(n, speed[n], speed[n] / speed[n0], speed[n] / speed[n0] * n0 / n,
                        low[n] / high[n0] * n0 / n, high[n] / low[n0] * n0 / n) for n in counts]
    chosen = n0
    for row in table[1:]:
        if row.efficiency < min_efficiency:
            break
        chosen = row.workers
    shown = "; ".join(f"{r.workers}: {r.samples_per_s:,.0f} samples/s, {r.speedup:.2f}x, efficiency "
                      f"{r.efficiency:.2f} ({r.low:.2f}-{r.high:.2f})" for r in table)
    after = next((r for r in table if r.workers > chosen), None)
    why = (f"{after.workers} workers reach efficiency {after.efficiency:.2f}, under scaling.min_efficiency "
           f"{min_efficiency:.2f}" if after else f"every count measured keeps efficiency >= {min_efficiency:.2f}")
    unsure = [r.workers for r in table[1:] if r.low < min_efficiency <= r.high]
    doubt = (f"; the epochs' spread puts {', '.join(map(str, unsure))} worker(s) on both sides of the threshold: "
             f"measure again with more epochs, or on a machine nothing else is using" if unsure else "")
    name = "one worker" if chosen == 1 else f"{chosen} workers"
    return WorkerAdvice(True, chosen, f"workers: use {name}: {why} (measured {shown}){doubt}", min_efficiency, table)


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

    def lines(self) -> list[str]:
        """The fits and recommendations as sentences, each with its numbers."""
        return [self.data_fit.summary(), self.model_fit.summary(), self.data_knee.sentence, self.model_knee.sentence,
                f"bound: {self.bound.verdict}: {self.bound.advice} ({'; '.join(self.bound.reasons)})",
                self.workers.sentence]


def analyse(points: list[ScalingPoint], cfg: ScalingConfig) -> StudyResult:
    """Fits, knees, the data/capacity verdict and the worker count, from the measured points."""
    val_rows = max((p.val_rows for p in points), default=0)
    fits = {}
    for axis, fit_axis in (("data", "data"), ("model", "parameters")):
        curve = on_axis(points, axis)
        fits[axis] = fit_power_law([size_of(p, axis) for p in curve], [p.val_error for p in curve], fit_axis,
                                   val_rows, cfg.min_gain, cfg.seed)
    data = still_falling(points, fits["data"], "data", cfg.min_gain)
    model = still_falling(points, fits["model"], "model", cfg.min_gain)
    return StudyResult(
        points=points, data_fit=fits["data"], model_fit=fits["model"],
        data_knee=find_knee(points, "data", cfg.tolerance), model_knee=find_knee(points, "model", cfg.tolerance),
        bound=bound(points, data, model, cfg.max_gap), workers=worker_advice(points, cfg.min_efficiency),
    )


def replace_point(spec: PointSpec, **measured) -> ScalingPoint:
    """A ScalingPoint from its spec and what was measured."""
    return ScalingPoint(**{**dataclasses.asdict(spec), **measured})


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
        lines = ["", "flyscale scaling study",
                 f"  points      {len(r.points)} training runs; trained now: {len(self.trained)}, from the cache: "
                 f"{len(self.cached)}"]
        for p in sorted(r.points, key=lambda p: p.key):
            lines.append(
                f"  point       {p.key:<34} {p.train_rows:>7,} rows {p.parameters:>9,} params  val error "
                f"{p.val_error:.4f}  train error {p.train_error:.4f}  gap {p.gap:+.4f}  "
                f"{p.samples_per_s:>8,.0f} samples/s "
                f"({p.samples_per_s_low:,.0f}-{p.samples_per_s_high:,.0f})"
            )
        lines += [f"  fit         {r.data_fit.summary()}", f"  fit         {r.model_fit.summary()}",
                  f"  knee        {r.data_knee.sentence}", f"  knee        {r.model_knee.sentence}",
                  f"  bound       {r.bound.verdict}: {r.bound.advice}"]
        lines += [f"              {reason}" for reason in r.bound.reasons]
        lines.append(f"  {r.workers.sentence.replace('workers: ', 'workers     ', 1)}")
        if self.parent_run_id:
            lines.append(f"  mlflow      parent run {self.parent_run_id} (experiment {self.experiment_id}) at "
                         f"{self.tracking_uri}: one child run per point")
        return "\n".join(lines)


def spec_model(base: ModelConfig, spec: PointSpec) -> ModelConfig:
    """The model of a point: the base model, with only the multipliers the point changes."""
    model = base
    if spec.width_multiplier != 1.0:
        model = point_model(model, WIDTH, spec.width_multiplier)
    if spec.depth_multiplier != 1.0:
        model = point_model(model, DEPTH, spec.depth_multiplier)
    return model
