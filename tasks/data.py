"""Data stages: fingerprint, load, validate (pandera, with quarantine), split, augment."""

from __future__ import annotations

from typing import Annotated, NamedTuple

import pandas as pd
from flytekit import HashMethod, task
from pandera.typing import DataFrame

from flyscale import data
from flyscale.caching import code_cache
from flyscale.config import AugmentConfig, DataConfig
from flyscale.contracts import DatasetInfo
from flyscale.data import DataFingerprint, ValidationReport
from flyscale.provenance import TaskRun
from flyscale.schemas import LabeledFrame, QuarantineFrame
from tasks.common import IMAGE, SMALL

Fingerprinted = NamedTuple("Fingerprinted", [("fingerprint", DataFingerprint), ("run", TaskRun)])
# Keyed by content downstream: a reload of identical bytes (a touched file) re-runs nothing after it.
Loaded = NamedTuple(
    "Loaded",
    [("raw", Annotated[pd.DataFrame, HashMethod(data.frame_hash)]), ("info", DatasetInfo), ("content", DataFingerprint),
     ("run", TaskRun)],
)
Validated = NamedTuple(
    "Validated",
    [("clean", DataFrame[LabeledFrame]), ("quarantined", DataFrame[QuarantineFrame]), ("report", ValidationReport),
     ("run", TaskRun)],
)
Splits = NamedTuple(
    "Splits",
    [("train", DataFrame[LabeledFrame]), ("val", DataFrame[LabeledFrame]), ("test", DataFrame[LabeledFrame]),
     ("run", TaskRun)],
)
Augmented = NamedTuple("Augmented", [("train", DataFrame[LabeledFrame]), ("run", TaskRun)])


# Never cached: it is how every run, scheduled ones included, learns that new bytes arrived
# under the same path. Its stamp is also when this execution started.
@task(cache=False, container_image=IMAGE, requests=SMALL)
def fingerprint_data(cfg: DataConfig) -> Fingerprinted:
    """The identity of the configured data as it is now (see the dataset's fingerprint())."""
    run = TaskRun.start("fingerprint_data")
    return Fingerprinted(fingerprint=data.fingerprint(cfg), run=run.done())


@task(cache=code_cache("datasets"), container_image=IMAGE, requests=SMALL)
def load_data(cfg: DataConfig, fingerprint: DataFingerprint) -> Loaded:
    """Load the configured dataset as it is, before any checks (keyed on the source's fingerprint),
    and the fingerprint of what was loaded (its content), which later stages record."""
    run = TaskRun.start("load_data")
    raw, info = data.load(cfg)
    return Loaded(raw=raw, info=info, content=data.content_fingerprint(raw, cfg), run=run.done())


@task(cache=code_cache("datasets"), container_image=IMAGE, requests=SMALL)
def validate_data(raw: pd.DataFrame, info: DatasetInfo, cfg: DataConfig) -> Validated:
    """Check every row against the dataset's schema; failing rows go to quarantine with reasons."""
    run = TaskRun.start("validate_data")
    clean, bad, report = data.validate(raw, cfg, info)
    return Validated(clean=clean, quarantined=bad, report=report, run=run.done())


@task(cache=code_cache(), container_image=IMAGE, requests=SMALL)
def split_data(clean: DataFrame[LabeledFrame], cfg: DataConfig) -> Splits:
    """Stratified, seeded train/validation/test split."""
    run = TaskRun.start("split_data")
    train, val, test = data.split(clean, cfg)
    return Splits(train=train, val=val, test=test, run=run.done())


@task(cache=code_cache("augmentations"), container_image=IMAGE, requests=SMALL)
def augment_data(train: DataFrame[LabeledFrame], info: DatasetInfo, cfg: AugmentConfig) -> Augmented:
    """Add augmented copies of the training rows (validation and test stay untouched)."""
    run = TaskRun.start("augment_data")
    return Augmented(train=data.augment(train, info, cfg), run=run.done())
