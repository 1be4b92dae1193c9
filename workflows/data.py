"""The two ways data becomes training splits; `training_pipeline` picks one with a Flyte
`conditional`, so the graph shows which ran. Wiring only.

- `in_memory_data`: load, validate, split (stratified) and augment, as DataFrames.
- `streamed_data`: for data larger than memory, one task validates it chunk by chunk and splits
  it as it streams by.

Both end in the same outputs: the three splits as Parquet shards, the quarantine, the report,
the info as validation held it to the reference, the data's profile and fingerprint, and the
stamps of the cached tasks that ran.
"""

from typing import NamedTuple

from flytekit import workflow
from flytekit.types.directory import FlyteDirectory

from flyscale.config import PipelineConfig
from flyscale.contracts import DatasetInfo
from flyscale.data import DataFingerprint
from flyscale.provenance import TaskRun
from flyscale.shards import Shards
from flyscale.validation import Profile, ValidationReport
from tasks.data import augment_data, load_data, prepare_stream, read_reference, split_data, validate_data

Prepared = NamedTuple(
    "Prepared",
    [("train", Shards), ("val", Shards), ("test", Shards), ("quarantined", Shards), ("report", ValidationReport),
     ("info", DatasetInfo), ("profile", Profile), ("report_files", FlyteDirectory), ("content", DataFingerprint),
     ("runs", list[TaskRun])],
)


@workflow
def in_memory_data(cfg: PipelineConfig, fingerprint: DataFingerprint) -> Prepared:
    """load -> reference -> validate -> split -> augment(train)."""
    raw, loaded_info, content, load_ran = load_data(cfg=cfg.data, fingerprint=fingerprint)
    reference = read_reference(cfg=cfg.data, store=cfg.mlflow, content=content)
    # `info` as validation held it to the reference (pinned classes); every later stage uses it.
    clean, quarantined, report, info, profile, report_files, validate_ran = validate_data(
        raw=raw, info=loaded_info, cfg=cfg.data, reference=reference
    )
    train, val, test, split_ran = split_data(clean=clean, cfg=cfg.data)
    augmented, augment_ran = augment_data(train=train, info=info, cfg=cfg.augment)
    return Prepared(
        augmented, val, test, quarantined, report, info, profile, report_files, content,
        [load_ran, validate_ran, split_ran, augment_ran],
    )


@workflow
def streamed_data(cfg: PipelineConfig, fingerprint: DataFingerprint) -> Prepared:
    """reference -> prepare the stream (validate chunk by chunk, split as it goes)."""
    # Held to the champion's reference by the source's fingerprint: hashing the content would read it all.
    reference = read_reference(cfg=cfg.data, store=cfg.mlflow, content=fingerprint)
    train, val, test, quarantined, report, info, profile, report_files, prepare_ran = prepare_stream(
        cfg=cfg.data, fingerprint=fingerprint, reference=reference
    )
    return Prepared(train, val, test, quarantined, report, info, profile, report_files, fingerprint, [prepare_ran])
