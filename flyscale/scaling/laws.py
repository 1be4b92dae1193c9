"""Fitting L(m) = alpha * m**beta + gamma (Hestness et al. 2017, "Deep learning scaling is
predictable, empirically"; Kaplan et al. 2020 for a language model's loss) to the validation
metric (a classifier's error, anyone else's loss) against training rows or tokens and against
parameter count, with an honest range for what doubling would buy (a bootstrap of the residuals)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

from flyscale.scaling.measure import binomial_noise

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
class PowerLawFit:
    """L(m) = alpha * m**beta + gamma fitted to the val metric against `axis`, or why not."""

    axis: str  # "data" (m: training rows or tokens) or "parameters" (m: parameter count)
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
    metric: str = "error"  # what was fitted: "error" or "loss"
    noun: str = ""  # what m counts on the data axis ("training rows", "training tokens")

    def predict(self, m: np.ndarray | float) -> np.ndarray:
        return self.alpha * np.asarray(m, dtype=float) ** self.beta + self.gamma

    def summary(self) -> str:
        noun = (self.noun or "training rows") if self.axis == "data" else "parameters"
        m = self.metric
        if not self.meaningful:
            return f"{m} vs {noun}: no fit ({self.reason})"
        return (
            f"{m} vs {noun}: {self.alpha:.3g} * m^{self.beta:.3f} + {self.gamma:.4f} (beta {self.beta:.3f}, "
            f"irreducible {m} gamma {self.gamma:.4f}); R^2 {self.r2_log:.3f} and RMSE {self.rmse_log:.3f} in "
            f"log space over {self.points} points. Doubling the {noun} ({self.largest:,.0f} -> "
            f"{2 * self.largest:,.0f}) would lower {m} by about {self.drop:.4f} (90% range "
            f"{self.drop_low:.4f}-{self.drop_high:.4f})"
        )


def sorted_curve(sizes: list[float], errors: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct sizes and the mean value at each."""
    m = np.asarray(sizes, dtype=float)
    e = np.asarray(errors, dtype=float)
    distinct = np.unique(m)
    return distinct, np.array([e[m == s].mean() for s in distinct])


def curve_noise(sizes: list[float], errors: list[float], noise: list[float] | None, val_rows: int) -> np.ndarray:
    """The standard error of each distinct size's value (as sorted_curve orders them): the
    measured one where given, else the binomial one of an error rate over `val_rows` rows.
    Repeats at one size average, so their noise shrinks by the square root of their number."""
    m, e = sorted_curve(sizes, errors)
    if noise is None or not any(noise):
        return np.array([binomial_noise(v, val_rows) for v in e])
    sizes_, noise_ = np.asarray(sizes, dtype=float), np.asarray(noise, dtype=float)
    return np.array([math.sqrt(np.sum(noise_[sizes_ == s] ** 2)) / np.sum(sizes_ == s) for s in m])


def trend(m: np.ndarray, e: np.ndarray, noise: np.ndarray, min_gain: float, metric: str = "error") -> str:
    """Why the curve has no power-law region, or "" when it falls. Changes under the larger of
    `min_gain` and twice the measurements' sampling noise are not changes."""

    def threshold(i: int, j: int) -> float:
        return max(min_gain, 2 * math.hypot(noise[i], noise[j]))

    lowest = int(np.argmin(e))
    if e[-1] - e[lowest] > threshold(-1, lowest):
        where = "with size" if lowest == 0 else f"after {m[lowest]:,.0f}"
        return (
            f"no power-law region: {metric} rises {where} ({e[lowest]:.4f} at {m[lowest]:,.0f}, {e[-1]:.4f} at "
            f"{m[-1]:,.0f}); more of it is making the model worse"
        )
    if e[0] - e[-1] <= threshold(0, -1):
        return (
            f"no power-law region: {metric} is flat ({e[0]:.4f} at {m[0]:,.0f}, {e[-1]:.4f} at {m[-1]:,.0f}, "
            f"a change under {threshold(0, -1):.4f}); the curve is at its floor or in the noise"
        )
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
                p, _ = curve_fit(
                    _log_model,
                    x,
                    y,
                    p0=p0,
                    bounds=([-30, BETA_BOUND, 0.0], [30, 0.0, g_max]),
                    maxfev=5000,
                    jac=_log_model_jacobian,
                )
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


def fit_power_law(
    sizes: list[float],
    errors: list[float],
    axis: str,
    val_rows: int = 0,
    min_gain: float = 0.005,
    seed: int = 0,
    noise: list[float] | None = None,
    metric: str = "error",
    noun: str = "",
) -> PowerLawFit:
    """Fit L(m) = alpha * m**beta + gamma to `errors` (an error rate or a loss), or say why a fit
    would mean nothing. `noise`: each value's standard error as measured; without it, the
    binomial one of an error rate over `val_rows` rows."""
    m, e = sorted_curve(sizes, errors)
    n = len(m)
    if n < MIN_FIT_POINTS:
        return PowerLawFit(
            axis,
            False,
            f"{n} distinct sizes measured; fitting alpha, beta and gamma needs at least "
            f"{MIN_FIT_POINTS}, one more than the form's 3 parameters, to judge it by",
            n,
            metric=metric,
            noun=noun,
        )
    sigma = curve_noise(sizes, errors, noise, val_rows)
    why = trend(m, e, sigma, min_gain, metric)
    if why:
        return PowerLawFit(axis, False, why, n, metric=metric, noun=noun)
    # A zero error has no logarithm: floor it at half a validation row (or 1e-4 when unknown).
    e = np.maximum(e, 0.5 / val_rows if val_rows else 1e-4)
    if noise is None or not any(noise):  # the binomial noise of the floored rate, not of a zero
        sigma = np.array([binomial_noise(v, val_rows) for v in e])
    x, y = m / m[-1], np.log(e)  # sizes relative to the largest, for conditioning
    g_max = float(e.min()) * (1 - 1e-9)
    p = _fit_once(x, y, _starts(x, e), g_max)
    if p is None:
        return PowerLawFit(axis, False, "the least-squares fit did not converge", n, metric=metric, noun=noun)
    resid = _log_model(x, *p) - y
    sst = float(np.sum((y - y.mean()) ** 2))
    r2 = 1 - float(np.sum(resid**2)) / sst if sst > 0 else 0.0
    rmse = float(np.sqrt(np.mean(resid**2)))
    if p[1] <= BETA_BOUND + 1e-3:
        gap = int(np.argmax(-np.diff(np.log(e))))  # the steepest step between neighbouring sizes
        return PowerLawFit(
            axis,
            False,
            f"{metric} falls as a cliff, not a power law (beta reached its bound "
            f"{BETA_BOUND:g}): most of the drop is between {m[gap]:,.0f} and "
            f"{m[gap + 1]:,.0f}; measure sizes in between",
            n,
            r2_log=r2,
            rmse_log=rmse,
            metric=metric,
            noun=noun,
        )
    if r2 < MIN_R2:
        return PowerLawFit(
            axis,
            False,
            f"the points do not follow a power law (R^2 {r2:.2f} in log space, under {MIN_R2})",
            n,
            r2_log=r2,
            rmse_log=rmse,
            metric=metric,
            noun=noun,
        )
    a, b, g = (float(v) for v in p)
    low, high = _bootstrap_drop(x, p, resid, sigma / e, seed)
    return PowerLawFit(
        axis,
        True,
        "",
        n,
        alpha=float(math.exp(a) * m[-1] ** -b),
        beta=b,
        gamma=g,
        r2_log=r2,
        rmse_log=rmse,
        largest=float(m[-1]),
        drop=math.exp(a) * (1 - 2**b),
        drop_low=low,
        drop_high=high,
        metric=metric,
        noun=noun,
    )


def _bootstrap_drop(x, p, resid, floor: np.ndarray, seed: int) -> tuple[float, float]:
    """The 90% range of the doubling's drop, by a parametric bootstrap: refit to the fitted curve
    plus noise, and take the drop of each refit.

    The noise is the residuals' scale, itself uncertain: with n - 3 degrees of freedom each
    replicate draws it as s * sqrt(dof / chi2(dof)) (with 4 points, dof = 1, this is what keeps
    the range honest; a fixed s covered the true drop 77% of the time, not 90%). It is never under
    `floor`, each point's sampling noise relative to its value (in log space, the noise of its
    log). Few points, or noisy ones, make the range wide.
    """
    rng = np.random.default_rng(seed)
    dof = max(len(x) - 3, 1)
    s = math.sqrt(float(np.sum(resid**2)) / dof)
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
