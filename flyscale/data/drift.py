"""How far new data has moved from the reference: histograms, the population stability index
(PSI) between two of them, and the few numbers MLflow logs of it (the histograms themselves are
counted as the data is prepared: flyscale/data/field_profile.py)."""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)


def histogram(values: np.ndarray, edges: np.ndarray) -> list[int]:
    """Counts in the bins between `edges`, the first and last open-ended (new data may go beyond)."""
    inner = np.asarray(edges)[1:-1]
    return np.bincount(np.searchsorted(inner, values, side="right"), minlength=len(inner) + 1).tolist()


def psi(expected: list[int], actual: list[int], eps: float = 1e-4) -> float:
    """Population stability index between two histograms on the same bins."""
    e = np.asarray(expected, dtype="float64")
    a = np.asarray(actual, dtype="float64")
    e = np.clip(e / max(e.sum(), 1), eps, None)
    a = np.clip(a / max(a.sum(), 1), eps, None)
    return float(np.sum((a - e) * np.log(a / e)))


SIGNIFICANT_PSI = 0.25  # the usual threshold of a significant shift, when data.max_drift_psi sets none
WORST_LOGGED = 5  # features logged by name: a wide dataset (an image's pixels) must not swamp MLflow


def summary(drift: dict[str, float], threshold: float) -> dict[str, float]:
    """What MLflow's metrics hold of drift, at most a handful however wide the data: the
    maximum, how many features are over `threshold` (or SIGNIFICANT_PSI when it is 0), the few
    worst by name and the label's. Every feature's PSI goes in a table artifact beside them."""
    if not drift:
        return {}
    threshold = threshold or SIGNIFICANT_PSI
    features = {k: v for k, v in drift.items() if k != "label"}
    worst = sorted(features.items(), key=lambda kv: -kv[1])[:WORST_LOGGED]
    out = {
        "drift_psi_max": max(drift.values()),
        "drift_threshold": threshold,
        "drift_features_over_threshold": float(sum(v > threshold for v in features.values())),
        **{f"drift_psi_{name}": value for name, value in worst},
    }
    if "label" in drift:
        out["drift_psi_label"] = drift["label"]
    return out
