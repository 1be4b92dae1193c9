"""How far new data has moved from the reference: per-feature histograms on the reference's
deciles, label counts, and the population stability index (PSI) of each against the reference."""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd

from flyscale.data.reference import FeatureProfile, Profile
from flyscale.plugin.records import DatasetInfo

log = logging.getLogger(__name__)


BINS = 10  # reference histograms: deciles of the reference data


def profile(frame: pd.DataFrame, info: DatasetInfo) -> Profile:
    """Decile histograms of every feature, and the label counts: the reference for later batches."""
    out = Profile(rows=len(frame))
    for name in info.feature_columns:
        values = frame[name].to_numpy(dtype="float64")
        edges = np.unique(np.quantile(values, np.linspace(0, 1, BINS + 1))) if len(values) else np.array([0.0])
        out.features[name] = FeatureProfile(edges=[float(e) for e in edges], counts=histogram(values, edges))
    labels = frame[info.label_column].astype("int64").value_counts()
    out.labels = {str(k): int(labels.get(k, 0)) for k in range(info.num_classes)}
    return out


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


def drift(frame: pd.DataFrame, info: DatasetInfo, ref: Profile) -> dict[str, float]:
    """PSI of each feature the reference profiled, and of the labels, for `frame` against `ref`."""
    out = {}
    for name, fp in ref.features.items():
        if name in frame:
            out[name] = psi(fp.counts, histogram(frame[name].to_numpy(dtype="float64"), np.asarray(fp.edges)))
    labels = frame[info.label_column].astype("int64").value_counts()
    classes = sorted(set(ref.labels) | {str(k) for k in labels.index})
    out["label"] = psi([ref.labels.get(c, 0) for c in classes], [int(labels.get(int(c), 0)) for c in classes])
    return out


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
