"""Data stages besides the shards' (tasks/examples.py): the data's fingerprint and kind, the
reference it is held to, a table's augmented copies, and the summary of a preparation. Every
kind ends with the splits as Parquet shards (flyscale/data/shards.py), which is all training
sees, and what validation found (tasks/records.py ValidatedData)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

from flytekit import task

from flyscale.config import AugmentConfig, DataConfig, MlflowConfig, TokenizeConfig
from flyscale.data import shards, source, validation
from flyscale.data.augment import augment
from flyscale.data.reference import Reference
from flyscale.data.shards import ContentShards, Shards
from flyscale.data.source import DataFingerprint
from flyscale.data.tokenize import pretrained_sha256
from flyscale.flyte.caching import code_cache
from flyscale.flyte.provenance import CacheReport, TaskRun, execution_key
from flyscale.plugin.data_kind import DataKind
from flyscale.plugin.records import DatasetInfo
from flyscale.render.data_summary import DataSummary
from flyscale.tracking.champion_reference import read_reference as read_reference_of
from flyscale.tracking.live import save_rejected
from tasks.common import SMALL, TASK, TRACKED
from tasks.records import ModelCheck, ValidatedData


class Fingerprinted(NamedTuple):
    fingerprint: DataFingerprint
    kind: DataKind  # which data branch prepares it
    tokenizer: str  # documents: the sha256 of the checkpoint tokenizer named ("" for byte or bpe)
    run: TaskRun


# Keyed by content downstream: augmented again into the same bytes, nothing after it re-runs.
class Augmented(NamedTuple):
    train: ContentShards
    runs: list[TaskRun]  # the data branch's stamps, then this task's


class Keyed(NamedTuple):
    train: ContentShards
    val: ContentShards


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


@task(cache=code_cache("augmentations"), **TASK, requests=SMALL)
def augment_data(train: Shards, info: DatasetInfo, cfg: AugmentConfig, runs: list[TaskRun]) -> Augmented:
    """Add `augment.copies` augmented copies of each of a table's training rows beside them
    (validation and test stay untouched). `runs`: the stamps of the tasks before it."""
    run = TaskRun.start("augment_data")
    rows = shards.read(train.dir.download(), [*info.feature_columns, info.label_column])
    return Augmented(shards.write(augment(rows, info, cfg), "train"), [*runs, run.done()])


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
