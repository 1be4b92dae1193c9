"""Validation of 1,000,000 rows: flyscale's (pandera, lazy, with quarantine reasons and the
duplicate check) against the same rules written as vectorised pandas by hand.

Both must find the same bad rows (checked before timing). Goal: ratio <= 2.0 (bar 3.0).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pandas as pd

from flyscale.config import DataConfig
from flyscale.data import validation
from flyscale.plugin import registry
from flyscale.plugin.records import DatasetInfo

ROWS = 1_000_000
FEATURES = [f"f{i}" for i in range(8)]
CLASSES = 10
GOAL, BAR = 2.0, 3.0


class Frames:
    """A dataset with no row schema of its own: flyscale builds it from the info."""

    def load(self, options):
        raise NotImplementedError

    def info(self, options):
        raise NotImplementedError


def _data(seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame(rng.random((ROWS, len(FEATURES))), columns=FEATURES)
    frame["label"] = rng.integers(0, CLASSES, ROWS)
    bad = rng.choice(ROWS, 4000, replace=False)
    frame.loc[bad[:1000], "f0"] = np.nan
    frame.loc[bad[1000:2000], "f1"] = np.inf
    frame.loc[bad[2000:3000], "f2"] = 7.0  # outside [0, 1]
    frame.loc[bad[3000:], "label"] = CLASSES + 3
    return frame


def by_hand(frame: pd.DataFrame) -> np.ndarray:
    """The same rules as vectorised pandas: the indexes of the rows to quarantine."""
    x = frame[FEATURES].to_numpy()
    bad = ~np.isfinite(x).all(axis=1)  # NaN or inf anywhere
    bad |= (frame["f2"].to_numpy() < 0) | (frame["f2"].to_numpy() > 1)
    labels = frame["label"].to_numpy()
    bad |= (labels < 0) | (labels >= CLASSES)
    bad |= frame.duplicated(keep="first").to_numpy() & ~bad
    return np.flatnonzero(bad)


def flyscale_rows(frame: pd.DataFrame, cfg: DataConfig, info: DatasetInfo) -> np.ndarray:
    _, quarantined, _, _ = validation.validate(frame, cfg, info)
    return np.sort(quarantined["row"].to_numpy())


def main() -> None:
    registry.datasets.register("bench_frames", Frames())
    frame = _data()
    info = DatasetInfo("bench", CLASSES, [len(FEATURES)], FEATURES, feature_ranges={"f2": [0.0, 1.0]})
    cfg = DataConfig(dataset="bench_frames", max_quarantine_fraction=0.5)
    assert np.array_equal(flyscale_rows(frame, cfg, info), by_hand(frame)), "the two validators disagree"
    ours, hand = [], []
    for _ in range(3):  # interleaved, so machine drift hits both alike
        start = time.perf_counter()
        flyscale_rows(frame, cfg, info)
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        by_hand(frame)
        hand.append(time.perf_counter() - start)
    o, h = statistics.median(ours), statistics.median(hand)
    ratio = o / h
    verdict = "met" if ratio <= GOAL else ("within the bar" if ratio <= BAR else "NOT met")
    print(f"bench_validation: {ROWS:,} rows x {len(FEATURES)} features + label, 4,000 bad")
    print(
        f"  flyscale (pandera)  {o:6.2f} s   vectorised pandas  {h:6.2f} s   ratio {ratio:.2f} "
        f"(goal <= {GOAL}, bar {BAR}: {verdict})"
    )
    registry.datasets.unregister("bench_frames")


if __name__ == "__main__":
    main()
