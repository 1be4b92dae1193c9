"""Data stages: fingerprint, then either (in memory) load, validate, split and augment, or (data
larger than memory) prepare the stream: validate chunk by chunk and split as it goes. Both end
with the splits as Parquet shards (flyscale/data/shards.py), which is all training sees, and
what validation found (tasks/records.py ValidatedData)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, NamedTuple

import pandas as pd
from flytekit import Deck, HashMethod, task
from flytekit.types.directory import FlyteDirectory
from pandera.typing import DataFrame

from flyscale.config import AugmentConfig, DataConfig, MlflowConfig, TokenizeConfig
from flyscale.data import shards, source, stream_prep, validation
from flyscale.data.augment import augment
from flyscale.data.drift import profile
from flyscale.data.reference import Reference
from flyscale.data.schemas import LabeledFrame
from flyscale.data.shards import ContentShards, Shards
from flyscale.data.source import DataFingerprint, frame_hash
from flyscale.data.split import split
from flyscale.data.tokenize import pretrained_sha256
from flyscale.flyte.caching import LIBRARIES, code_cache
from flyscale.flyte.content import BY_CONTENT
from flyscale.flyte.provenance import UNSTAMPED, CacheReport, TaskRun, execution_key, stamped
from flyscale.plugin.data_kind import DataKind
from flyscale.plugin.records import DatasetInfo
from flyscale.render import validation_report
from flyscale.render.data_summary import DataSummary
from flyscale.tracking.champion_reference import read_reference as read_reference_of
from flyscale.tracking.live import save_rejected
from tasks.common import DECKS, SMALL, TASK, TRACKED
from tasks.records import ModelCheck, ValidatedData


class Fingerprinted(NamedTuple):
    fingerprint: DataFingerprint
    kind: DataKind  # which data branch prepares it
    tokenizer: str  # documents: the sha256 of the checkpoint tokenizer named ("" for byte or bpe)
    run: TaskRun


# Keyed by content downstream: a reload of identical bytes (a touched file) re-runs nothing after it.
class Loaded(NamedTuple):
    raw: Annotated[pd.DataFrame, HashMethod(frame_hash)]
    info: DatasetInfo
    content: DataFingerprint
    run: TaskRun = UNSTAMPED  # filled in by @stamped


# The clean rows are keyed by content downstream: re-validated against a new reference, the same
# rows re-run nothing after them (no retraining because the champion changed).
class Validated(NamedTuple):
    clean: Annotated[DataFrame[LabeledFrame], HashMethod(frame_hash)]
    validated: Annotated[ValidatedData, BY_CONTENT]
    run: TaskRun = UNSTAMPED  # filled in by @stamped


# Every split, table and record below is keyed by content downstream (ContentShards, BY_CONTENT):
# a task that runs again and writes the same bytes re-runs nothing after it.
class Splits(NamedTuple):
    train: Annotated[DataFrame[LabeledFrame], HashMethod(frame_hash)]
    val: ContentShards
    test: ContentShards
    run: TaskRun = UNSTAMPED  # filled in by @stamped


class Augmented(NamedTuple):
    train: ContentShards
    run: TaskRun = UNSTAMPED  # filled in by @stamped


class Keyed(NamedTuple):
    train: ContentShards
    val: ContentShards


class Streamed(NamedTuple):
    train: ContentShards
    val: ContentShards
    test: ContentShards
    validated: Annotated[ValidatedData, BY_CONTENT]
    run: TaskRun = UNSTAMPED  # filled in by @stamped


# Never cached: it is how every run, scheduled ones included, learns that new bytes arrived
# under the same path. Its stamp is also when this execution started.
@task(cache=False, **TASK, requests=SMALL)
def fingerprint_data(
    cfg: DataConfig,
    tokenize: TokenizeConfig = TokenizeConfig(),  # noqa: B008 (a Flyte input's default is its value)
    model: ModelCheck | None = None,
) -> Fingerprinted:
    """The identity of the configured data as it is now (see the dataset's fingerprint()), and for
    documents that of the checkpoint tokenizer they will be tokenized with. `model`: an input so
    that no data is read before the model passed its check (none when the data is prepared
    without training)."""
    run = TaskRun.start("fingerprint_data", execution=execution_key())
    kind = source.kind(cfg)
    return Fingerprinted(
        fingerprint=source.fingerprint(cfg),
        kind=kind,
        tokenizer=pretrained_sha256(tokenize) if kind is DataKind.DOCUMENTS else "",
        run=run.done(),
    )


@task(cache=code_cache("datasets"), **TASK, requests=SMALL)
@stamped
def load_data(cfg: DataConfig, fingerprint: DataFingerprint) -> Loaded:
    """Load the configured dataset as it is, before any checks (keyed on the source's fingerprint),
    and the fingerprint of what was loaded (its content), which later stages record."""
    raw, info = source.load(cfg)
    return Loaded(raw=raw, info=info, content=source.content_fingerprint(raw, cfg))


# Never cached: it reads the champion as it is now (or a reference file), like the gate.
@task(cache=False, **TRACKED, requests=SMALL)
def read_reference(cfg: DataConfig, store: MlflowConfig, content: DataFingerprint) -> Reference:
    """The reference the data is validated against: the champion's pinned schema and data profile."""
    return read_reference_of(store, cfg.reference, content.value)


@contextlib.contextmanager
def rejected_rows_kept(store: MlflowConfig) -> Iterator[None]:
    """Data rejected for too many bad rows loses none of them: the quarantine goes to the
    execution's MLflow run, and the error says where."""
    try:
        yield
    except validation.CeilingExceeded as exc:
        report = exc.report
        counts = {
            "validation_total_rows": report.total_rows,
            "validation_valid_rows": report.valid_rows,
            "validation_quarantined_rows": report.quarantined_rows,
        }
        try:
            run_id = save_rejected(store, execution_key(), exc.quarantine_dir, counts)
            kept = f"Every quarantined row and its reason is kept: artifacts data/quarantine/ of MLflow run {run_id}"
        except Exception as mlflow_exc:  # noqa: BLE001 (the rejection is the error to report; say where the rows are)
            kept = f"MLflow could not keep the quarantine ({mlflow_exc}); it is in {exc.quarantine_dir}"
        raise validation.CeilingExceeded(f"{exc} {kept}.", report) from exc


@task(
    cache=code_cache("datasets", libraries=(*LIBRARIES, "matplotlib")),
    **TRACKED,  # rejected rows are kept in MLflow
    requests=SMALL,
    enable_deck=True,
    deck_fields=DECKS,
)
@stamped
def validate_data(
    raw: pd.DataFrame,
    info: DatasetInfo,
    content: DataFingerprint,
    cfg: DataConfig,
    reference: Reference,
    store: MlflowConfig,
) -> Validated:
    """Check every row against the dataset's schema; failing rows go to quarantine with reasons."""
    with rejected_rows_kept(store):
        clean, bad, report, pinned = validation.validate(raw, cfg, info, reference)
    data_profile = profile(clean, pinned)
    files = validation_report.write(report, bad, clean, pinned, data_profile, reference)
    Deck("Data validation", (Path(files) / "validation.html").read_text())
    found = ValidatedData(pinned, content, report, shards.write(bad, "quarantine"), data_profile, FlyteDirectory(files))
    return Validated(clean, found)


@task(cache=code_cache(), **TASK, requests=SMALL)
@stamped
def split_data(clean: DataFrame[LabeledFrame], cfg: DataConfig) -> Splits:
    """Stratified, seeded train/validation/test split."""
    train, val, test = split(clean, cfg)
    return Splits(train=train, val=shards.write(val, "val"), test=shards.write(test, "test"))


@task(cache=code_cache("augmentations"), **TASK, requests=SMALL)
@stamped
def augment_data(train: DataFrame[LabeledFrame], info: DatasetInfo, cfg: AugmentConfig) -> Augmented:
    """Add augmented copies of the training rows (validation and test stay untouched)."""
    return Augmented(train=shards.write(augment(train, info, cfg), "train"))


@task(
    cache=code_cache("datasets", libraries=(*LIBRARIES, "matplotlib")),
    **TRACKED,  # rejected rows are kept in MLflow
    requests=SMALL,
    enable_deck=True,
    deck_fields=DECKS,
)
@stamped
def prepare_stream(
    cfg: DataConfig, fingerprint: DataFingerprint, reference: Reference, store: MlflowConfig
) -> Streamed:
    """For data larger than memory: validate it chunk by chunk, and write the quarantine and the
    three splits as shards as it streams by (keyed on the source's fingerprint)."""
    info = source.info(cfg)
    with rejected_rows_kept(store):
        prepared = stream_prep.prepare(source.chunks(cfg), cfg, info, reference, seed=cfg.seed)
    quarantined = shards.head(prepared.quarantined.dir.path, 10_000)  # what the report shows examples of
    files = validation_report.write(
        prepared.report, quarantined, prepared.sample, prepared.info, prepared.profile, reference
    )
    Deck("Data validation", (Path(files) / "validation.html").read_text())
    # Held to the reference by the source's fingerprint: hashing the content would read it all.
    found = ValidatedData(
        prepared.info, fingerprint, prepared.report, prepared.quarantined, prepared.profile, FlyteDirectory(files)
    )
    return Streamed(prepared.train, prepared.val, prepared.test, found)


# Never cached: it computes nothing. Inside a @dynamic the splits are plain values, which enter the
# cache keys of the tasks they are handed to by where they were written; handed on through this
# task they enter by their content (the sha256 each was written with: nothing is read).
@task(cache=False, **TASK, requests=SMALL)
def by_content(train: Shards, val: Shards) -> Keyed:
    """The splits as they are, keyed by their content in the tasks they are handed to."""
    return Keyed(train, val)


@task(cache=False, **TASK, requests=SMALL)
def summarize_data(
    cfg: DataConfig,
    train: Shards,
    val: Shards,
    test: Shards,
    validated: ValidatedData,
    runs: list[TaskRun],
    started: TaskRun,
) -> DataSummary:
    """The summary of a data preparation, with where its splits are and which tasks ran."""
    splits = {"train": train, "val": val, "test": test, "quarantine": validated.quarantined}
    return DataSummary(
        dataset=cfg.dataset,
        info=validated.info,
        validation=validated.report,
        fingerprint=validated.content,
        splits={name: s.rows for name, s in splits.items() if name != "quarantine"},
        where={**{name: s.dir.path for name, s in splits.items()}, "report": validated.report_files.path},
        tokens=validated.tokens,
        cache=CacheReport.of(runs, started.started_at, ["fingerprint_data", "read_reference"]),
    )
