"""The ways data becomes training splits, one picked by a Flyte `conditional` in `dataset` (so
the graph shows which ran), and `prepare_data`, which prepares a dataset without training on it.
Wiring only.

- `examples_data`: every kind of data is prepared here as typed examples: each shard of the
  dataset is validated field by field and split by a task of its own (a map task), and one small
  task combines them. A table is examples of a field per column (flyscale/data/table_examples.py),
  in one shard; one larger than memory is read chunk by chunk.
- `table_data`: a table in memory, prepared so, and then its training rows' augmented copies.
- `text_data`: documents, prepared so, then tokenized and packed into sequences.

All end in the same outputs: the three splits as Parquet shards, what validation found
(tasks/records.py ValidatedData), and the stamps of the cached tasks that ran.
"""

from typing import NamedTuple

from flytekit import conditional, workflow

from flyscale.config import PipelineConfig
from flyscale.data.shards import Shards
from flyscale.data.source import DataFingerprint
from flyscale.flyte.provenance import TaskRun
from flyscale.plugin.data_kind import DataKind
from flyscale.render.data_summary import DataSummary
from tasks.data import augment_data, fingerprint_data, read_reference, summarize_data
from tasks.examples import combine_shards, plan_shards, prepare_shards
from tasks.records import ValidatedData
from tasks.text import tokenize_text


class Prepared(NamedTuple):
    train: Shards
    val: Shards
    test: Shards
    validated: ValidatedData
    runs: list[TaskRun]


@workflow
def examples_data(cfg: PipelineConfig, fingerprint: DataFingerprint) -> Prepared:
    """reference -> plan the shards -> prepare each shard (a map task) -> combine them."""
    reference = read_reference(cfg=cfg.data, store=cfg.mlflow, content=fingerprint)
    plan = plan_shards(cfg=cfg.data, fingerprint=fingerprint, reference=reference)
    parts = prepare_shards(shard=plan.shards, cfg=cfg.data, info=plan.info, fingerprint=fingerprint, edges=plan.edges)
    train, val, test, validated, runs = combine_shards(
        parts=parts, cfg=cfg.data, info=plan.info, fingerprint=fingerprint, reference=reference, store=cfg.mlflow
    )
    return Prepared(train, val, test, validated, runs)


@workflow
def table_data(cfg: PipelineConfig, fingerprint: DataFingerprint) -> Prepared:
    """a table in memory: prepared as typed examples of a field per column -> augment(train)."""
    train, val, test, validated, prepared = examples_data(cfg=cfg, fingerprint=fingerprint)
    augmented, runs = augment_data(train=train, info=validated.info, cfg=cfg.augment, runs=prepared)
    return Prepared(augmented, val, test, validated, runs)


@workflow
def text_data(cfg: PipelineConfig, fingerprint: DataFingerprint, tokenizer: str) -> Prepared:
    """the documents as examples (plan, map, combine) -> tokenize and pack each split (keyed on
    `tokenizer`, the sha256 of a checkpoint's tokenizer)."""
    docs_train, docs_val, docs_test, docs, prepared = examples_data(cfg=cfg, fingerprint=fingerprint)
    train, val, test, validated, _, runs = tokenize_text(
        train=docs_train,
        val=docs_val,
        test=docs_test,
        validated=docs,
        cfg=cfg.tokenize,
        runs=prepared,
        pretrained_sha256=tokenizer,
    )
    return Prepared(train, val, test, validated, runs)


@workflow
def dataset(cfg: PipelineConfig, fingerprint: DataFingerprint, kind: DataKind, tokenizer: str) -> Prepared:
    """The branch that fits the data's kind (fingerprint_data decides it, and reads the tokenizer)."""
    return (
        conditional("data")
        .if_(kind == DataKind.DOCUMENTS.value)
        .then(text_data(cfg=cfg, fingerprint=fingerprint, tokenizer=tokenizer))
        .elif_(kind == DataKind.TABLE.value)
        .then(table_data(cfg=cfg, fingerprint=fingerprint))
        .else_()
        .then(examples_data(cfg=cfg, fingerprint=fingerprint))
    )


@workflow
def prepare_data(cfg: PipelineConfig = PipelineConfig()) -> DataSummary:  # noqa: B008 (a Flyte input's default)
    """fingerprint -> the data branch that fits -> a summary: validate, quarantine, split (and for text
    tokenize) without training, e.g. to look at a new dataset before a run."""
    fingerprint, kind, tokenizer, started = fingerprint_data(cfg=cfg.data, tokenize=cfg.tokenize)
    train, val, test, validated, runs = dataset(cfg=cfg, fingerprint=fingerprint, kind=kind, tokenizer=tokenizer)
    return summarize_data(
        cfg=cfg.data, train=train, val=val, test=test, validated=validated, runs=runs, started=started
    )
