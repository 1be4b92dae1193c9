"""Data stages for typed examples (images, text, and a table as examples of a field per column):
plan the shards, prepare each shard (a Flyte map task: a pod per shard on a cluster),
then combine them into the splits, the quarantine and the report. No DataFrame of a column per
element is ever made."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, NamedTuple

import pandas as pd
from flytekit import Deck, map_task, task
from flytekit.types.directory import FlyteDirectory

from flyscale.config import DataConfig, MlflowConfig
from flyscale.data import example_combine, example_prep, field_profile, shards, source, table_examples
from flyscale.data.example_prep import ORIGIN, ShardPart
from flyscale.data.reference import Reference, pin
from flyscale.data.shards import ContentShards, Shards
from flyscale.data.source import DataFingerprint
from flyscale.flyte.caching import LIBRARIES, code_cache
from flyscale.flyte.content import BY_CONTENT
from flyscale.flyte.dataclass_types import register
from flyscale.flyte.provenance import TaskRun
from flyscale.plugin.records import DatasetInfo
from flyscale.render import validation_report
from tasks.common import DECKS, SMALL, TASK, TRACKED
from tasks.data import rejected_rows_kept
from tasks.records import ValidatedData

LIBRARIES_READ = (*LIBRARIES, "pillow", "tokenizers")  # what decodes and checks the examples


@dataclass
class ShardRef:
    """One shard of the dataset and its position among them (what orders the combine)."""

    index: int
    name: str


@dataclass
class ShardPlan:
    """The dataset's shards, the info every shard is checked against (held to the reference; a
    table's with a field per column), and the reference's bins of a table's columns."""

    info: DatasetInfo
    shards: list[ShardRef]
    edges: dict[str, list[float]]


register(ShardRef, ShardPlan)


@task(cache=code_cache("datasets"), **TASK, requests=SMALL)
def plan_shards(cfg: DataConfig, fingerprint: DataFingerprint, reference: Reference) -> ShardPlan:
    """List the dataset's shards (keyed on its fingerprint), and pin what it inferred to the reference."""
    info = table_examples.fields_of(pin(source.info(cfg), reference, f"dataset {cfg.dataset!r}"))
    shards_ = [ShardRef(i, name) for i, name in enumerate(source.shards(cfg))]
    return ShardPlan(info, shards_, field_profile.reference_edges(info, reference.profile))


# Keyed by content downstream: combined again into the same bytes, nothing after it re-runs.
class Combined(NamedTuple):
    train: ContentShards
    val: ContentShards
    test: ContentShards
    validated: Annotated[ValidatedData, BY_CONTENT]
    runs: list[TaskRun]  # the combine's stamp, then each shard's


@task(cache=code_cache("datasets", libraries=LIBRARIES_READ), **TASK, requests=SMALL)
def prepare_shard(
    shard: ShardRef, cfg: DataConfig, info: DatasetInfo, fingerprint: DataFingerprint, edges: dict[str, list[float]]
) -> ShardPart:
    """Validate one shard field by field, quarantine what fails (and repeats within it), and
    write its part of the splits. `fingerprint`: the data's identity, part of the cache key."""
    run = TaskRun.start("prepare_shard")
    batches = source.examples(cfg, shard.name)
    part = example_prep.prepare_shard(batches, cfg, info, shard.index, shard.name, cfg.keep_encoded, edges)
    part.run = run.done()
    return part


# Concurrency is left to the execution: locally flytekit runs the shards one after another; on a
# cluster as many pods at once as `pyflyte run --remote --max-parallelism N` (or the project's
# default) allows. The result does not depend on it.
prepare_shards = map_task(prepare_shard, bound_inputs={"cfg", "info", "fingerprint", "edges"})


@task(
    cache=code_cache("datasets", libraries=(*LIBRARIES_READ, "matplotlib")),
    **TRACKED,  # rejected examples are kept in MLflow
    requests=SMALL,
    enable_deck=True,
    deck_fields=DECKS,
)
def combine_shards(
    parts: list[ShardPart],
    cfg: DataConfig,
    info: DatasetInfo,
    fingerprint: DataFingerprint,
    reference: Reference,
    store: MlflowConfig,
) -> Combined:
    """Find duplicates across shards, assemble the splits, and report what validation found."""
    run = TaskRun.start("combine_shards")
    with rejected_rows_kept(store):
        prepared = example_combine.combine(parts, cfg, info, reference)
    shown = [*ORIGIN, "reason"]  # what the report shows of each quarantined example (not its pixels)
    quarantined = (
        shards.head_table(prepared.quarantined.dir.path, 10_000, shown).to_pandas()
        if prepared.quarantined.rows
        else pd.DataFrame(columns=shown)
    )
    files = validation_report.write(prepared.report, quarantined, prepared.profile, reference)
    Deck("Data validation", (Path(files) / "validation.html").read_text())
    found = ValidatedData(
        table_examples.as_table(prepared.info),
        fingerprint,
        prepared.report,
        prepared.quarantined,
        prepared.profile,
        FlyteDirectory(files),
    )
    train, val, test = (
        Shards(s.dir, s.rows, cfg.streaming, s.sha256) for s in (prepared.train, prepared.val, prepared.test)
    )
    return Combined(train, val, test, found, [run.done(), *(p.run for p in parts if p.run is not None)])
