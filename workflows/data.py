"""The three ways data becomes training splits; `training_pipeline` picks one with a Flyte
`conditional`, so the graph shows which ran. Wiring only.

- `in_memory_data`: load, validate, split (stratified) and augment, as DataFrames.
- `streamed_data`: for data larger than memory, one task validates it chunk by chunk and splits
  it as it streams by.
- `examples_data`: for typed examples (images, text), each shard of the dataset is validated
  field by field and split by a task of its own (a map task), and one small task combines them.

All three end in the same outputs: the three splits as Parquet shards, what validation found
(tasks/records.py ValidatedData), and the stamps of the cached tasks that ran.
"""

from typing import NamedTuple

from flytekit import workflow

from flyscale.config import PipelineConfig
from flyscale.data.shards import Shards
from flyscale.data.source import DataFingerprint
from flyscale.flyte.provenance import TaskRun
from tasks.data import augment_data, load_data, prepare_stream, read_reference, split_data, validate_data
from tasks.examples import combine_shards, plan_shards, prepare_shards
from tasks.records import ValidatedData


class Prepared(NamedTuple):
    train: Shards
    val: Shards
    test: Shards
    validated: ValidatedData
    runs: list[TaskRun]


@workflow
def in_memory_data(cfg: PipelineConfig, fingerprint: DataFingerprint) -> Prepared:
    """load -> reference -> validate -> split -> augment(train)."""
    raw, loaded_info, content, load_ran = load_data(cfg=cfg.data, fingerprint=fingerprint)
    reference = read_reference(cfg=cfg.data, store=cfg.mlflow, content=content)
    # `validated.info` is the info as validation held it to the reference (pinned classes); every later stage uses it.
    clean, validated, validate_ran = validate_data(
        raw=raw, info=loaded_info, content=content, cfg=cfg.data, reference=reference, store=cfg.mlflow
    )
    train, val, test, split_ran = split_data(clean=clean, cfg=cfg.data)
    augmented, augment_ran = augment_data(train=train, info=validated.info, cfg=cfg.augment)
    return Prepared(augmented, val, test, validated, [load_ran, validate_ran, split_ran, augment_ran])


@workflow
def streamed_data(cfg: PipelineConfig, fingerprint: DataFingerprint) -> Prepared:
    """reference -> prepare the stream (validate chunk by chunk, split as it goes)."""
    # Held to the champion's reference by the source's fingerprint: hashing the content would read it all.
    reference = read_reference(cfg=cfg.data, store=cfg.mlflow, content=fingerprint)
    train, val, test, validated, prepare_ran = prepare_stream(
        cfg=cfg.data, fingerprint=fingerprint, reference=reference, store=cfg.mlflow
    )
    return Prepared(train, val, test, validated, [prepare_ran])


@workflow
def examples_data(cfg: PipelineConfig, fingerprint: DataFingerprint) -> Prepared:
    """reference -> plan the shards -> prepare each shard (a map task) -> combine them."""
    reference = read_reference(cfg=cfg.data, store=cfg.mlflow, content=fingerprint)
    plan = plan_shards(cfg=cfg.data, fingerprint=fingerprint, reference=reference)
    parts = prepare_shards(shard=plan.shards, cfg=cfg.data, info=plan.info, fingerprint=fingerprint)
    train, val, test, validated, runs = combine_shards(
        parts=parts, cfg=cfg.data, info=plan.info, fingerprint=fingerprint, reference=reference, store=cfg.mlflow
    )
    return Prepared(train, val, test, validated, runs)
