"""What preparing a dataset yields, and what every preparation shares: examples assigned to a
split by a seeded hash of where they came from (so the same data always splits the same way,
whether it is read at once, chunk by chunk or shard by shard, and memory never holds it), and the
index of kept examples' content hashes by which repeats are found (then confirmed by their values)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from flyscale.config import DataConfig
from flyscale.data import validation
from flyscale.data.reference import Profile
from flyscale.data.shards import Shards
from flyscale.data.validation import ValidationReport
from flyscale.plugin.records import SOURCE_FILE, SOURCE_ROW, DatasetInfo

DUPLICATE = validation.DUPLICATE


@dataclass
class Prepared:
    train: Shards
    val: Shards
    test: Shards
    quarantined: Shards
    report: ValidationReport
    profile: Profile
    info: DatasetInfo


def split_of(origin: pd.DataFrame, cfg: DataConfig, root: str = "") -> np.ndarray:
    """0 train, 1 validation, 2 test, by a seeded hash of each row's origin: its file's path below
    `root` (DatasetInfo.root) and its row."""
    key = f"flyscale{cfg.seed:08d}"[-16:]
    named = origin[[SOURCE_FILE, SOURCE_ROW]]
    if root:
        below = named[SOURCE_FILE].astype(str).str.removeprefix(root.rstrip("/")).str.lstrip("/")
        named = named.assign(**{SOURCE_FILE: below})
    h = pd.util.hash_pandas_object(named, index=False, hash_key=key).to_numpy()
    u = (h % np.uint64(1_000_000)).astype("float64") / 1_000_000
    return np.where(u < cfg.test_fraction, 2, np.where(u < cfg.test_fraction + cfg.val_fraction, 1, 0))


class SeenRows:
    """Every kept row's content hash and where it was written (its split and position there), as
    sorted runs of (hash, location), 16 bytes a row, merged as they grow."""

    def __init__(self):
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []

    def lookup(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which hashes were seen, the location of a row seen with each)."""
        found = np.zeros(len(hashes), dtype=bool)
        where = np.zeros(len(hashes), dtype="uint64")
        for keys, locations in self._runs:
            at = np.minimum(np.searchsorted(keys, hashes), len(keys) - 1)
            hit = ~found & (keys[at] == hashes)
            found |= hit
            where[hit] = locations[at[hit]]
        return found, where

    def add(self, hashes: np.ndarray, locations: np.ndarray) -> None:
        if not len(hashes):  # a shard that kept nothing: an empty run would have no last key to look at
            return
        order = np.argsort(hashes, kind="stable")
        self._runs.append((hashes[order], locations[order]))
        while len(self._runs) > 1 and len(self._runs[-1][0]) * 2 >= len(self._runs[-2][0]):
            (top_k, top_l), (below_k, below_l) = self._runs.pop(), self._runs.pop()
            keys, locations = np.concatenate([below_k, top_k]), np.concatenate([below_l, top_l])
            order = np.argsort(keys, kind="stable")
            self._runs.append((keys[order], locations[order]))
