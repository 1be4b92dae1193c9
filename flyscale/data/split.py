"""The stratified, seeded train / validation / test split of the validated rows."""

from __future__ import annotations

import logging
import math

import numpy as np
import pandas as pd

from flyscale.config import DataConfig
from flyscale.errors import require

log = logging.getLogger(__name__)


def split(frame: pd.DataFrame, cfg: DataConfig) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Stratified, seeded train/validation/test split (every label in each part in proportion)."""
    rng = np.random.default_rng(cfg.seed)
    rest, test = _stratified(frame["label"].to_numpy(), cfg.test_fraction, rng)
    val_share = cfg.val_fraction / (1.0 - cfg.test_fraction)
    train, val = _stratified(frame["label"].to_numpy()[rest], val_share, rng)
    parts = (rest[train], rest[val], test)
    every = np.concatenate(parts)
    require(
        len(every) == len(frame) and len(np.unique(every)) == len(frame),
        f"the split of {len(frame)} rows gave {[len(p) for p in parts]} rows, "
        f"{len(every) - len(np.unique(every))} of them in two parts",
    )
    train_rows, val_rows, test_rows = (frame.iloc[p].reset_index(drop=True) for p in parts)
    return train_rows, val_rows, test_rows


def _stratified(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Row positions of (the rest, a held-out `fraction` of the rows), each shuffled.

    The held-out count is ceil(fraction x rows), shared among the labels in proportion to their
    rows, the rows left over going to the labels with the largest remainders. (Written here, not
    scikit-learn's train_test_split: importing scikit-learn costs every run 2-3 s.)
    """
    classes, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    if counts.min() < 2:
        raise ValueError(
            f"label {classes[counts.argmin()].item()!r} has only 1 row: a stratified split needs at least 2 rows "
            "of every label; drop the label or add rows"
        )
    n_out = math.ceil(fraction * len(labels))
    share = counts * n_out / len(labels)
    take = np.floor(share).astype(int)
    take[np.argsort(take - share, kind="stable")[: n_out - take.sum()]] += 1
    rest, out = [], []
    for c, k in enumerate(take):
        rows = rng.permutation(np.flatnonzero(inverse == c))
        out.append(rows[:k])
        rest.append(rows[k:])
    return rng.permutation(np.concatenate(rest)), rng.permutation(np.concatenate(out))
