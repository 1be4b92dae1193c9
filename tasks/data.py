"""Data stages: load, validate (pandera, with quarantine), split, augment."""

from __future__ import annotations

from typing import NamedTuple

import pandas as pd
from flytekit import task
from pandera.typing import DataFrame

from flyscale import data
from flyscale.caching import code_cache
from flyscale.config import AugmentConfig, DataConfig
from flyscale.contracts import DatasetInfo
from flyscale.data import ValidationReport
from flyscale.schemas import LabeledFrame, QuarantineFrame
from tasks.common import IMAGE, SMALL

Loaded = NamedTuple("Loaded", [("raw", pd.DataFrame), ("info", DatasetInfo)])
Validated = NamedTuple(
    "Validated",
    [("clean", DataFrame[LabeledFrame]), ("quarantined", DataFrame[QuarantineFrame]), ("report", ValidationReport)],
)
Splits = NamedTuple(
    "Splits", [("train", DataFrame[LabeledFrame]), ("val", DataFrame[LabeledFrame]), ("test", DataFrame[LabeledFrame])]
)


@task(cache=code_cache("datasets"), container_image=IMAGE, requests=SMALL)
def load_data(cfg: DataConfig) -> Loaded:
    """Load the configured dataset as it is, before any checks."""
    raw, info = data.load(cfg)
    return Loaded(raw=raw, info=info)


@task(cache=code_cache("datasets"), container_image=IMAGE, requests=SMALL)
def validate_data(raw: pd.DataFrame, info: DatasetInfo, cfg: DataConfig) -> Validated:
    """Check every row against the dataset's schema; failing rows go to quarantine with reasons."""
    clean, bad, report = data.validate(raw, cfg, info)
    return Validated(clean=clean, quarantined=bad, report=report)


@task(cache=code_cache(), container_image=IMAGE, requests=SMALL)
def split_data(clean: DataFrame[LabeledFrame], cfg: DataConfig) -> Splits:
    """Stratified, seeded train/validation/test split."""
    train, val, test = data.split(clean, cfg)
    return Splits(train=train, val=val, test=test)


@task(cache=code_cache("augmentations"), container_image=IMAGE, requests=SMALL)
def augment_data(train: DataFrame[LabeledFrame], info: DatasetInfo, cfg: AugmentConfig) -> DataFrame[LabeledFrame]:
    """Add augmented copies of the training rows (validation and test stay untouched)."""
    return data.augment(train, info, cfg)
