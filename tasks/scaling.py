"""Scaling-study stages. The study is a @dynamic of ordinary cached training runs: a nested
subset of the training rows per data fraction, and one training task per worker count (the
training job of the pipeline under a launcher of that many processes, which then measures the
point it trained). Then the report (a Deck, and an MLflow parent run with a child run per
point) and the summary. The logic and the rendering are flyscale/scaling/.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import tempfile
from typing import NamedTuple

import numpy as np
from flytekit import Deck, dynamic, task
from flytekit.types.error import FlyteError

from flyscale import settings
from flyscale.cluster import resources
from flyscale.cluster.image import PinnedImageResolver
from flyscale.cluster.launcher_settings import training_retries
from flyscale.cluster.launchers import elastic_launcher
from flyscale.config import (
    AugmentConfig,
    MlflowConfig,
    ModelConfig,
    ObjectiveConfig,
    PipelineConfig,
    RecoveryConfig,
    TrainConfig,
)
from flyscale.data import fields, shards
from flyscale.data.augment import augment
from flyscale.data.shards import ContentShards, Shards
from flyscale.data.source import DataFingerprint
from flyscale.data.tensors import batches
from flyscale.flyte.caching import LIBRARIES, code_cache
from flyscale.flyte.dataclass_types import register
from flyscale.flyte.provenance import TaskRun, execution_key
from flyscale.model import build_model, load_state
from flyscale.plugin.records import DatasetInfo
from flyscale.scaling.advice import (
    Bound,
    Knee,
    StudyResult,
    StudySummary,
    analyse,
)
from flyscale.scaling.config import ScalingConfig, StudyConfig
from flyscale.scaling.laws import PowerLawFit
from flyscale.scaling.measure import measure, metric_of, unit_of
from flyscale.scaling.plan import (
    PointSpec,
    ScalingPoint,
    nested_subset,
    plan,
    replace_point,
    spec_model,
    throughput,
)
from flyscale.scaling.plots import plot_study
from flyscale.scaling.report import html_page, log_study
from flyscale.scaling.worker_count import Efficiency, WorkerAdvice
from flyscale.tracking.live import close_failed_runs
from flyscale.tracking.store import tracking_uri
from flyscale.train import objective as objectives
from flyscale.train.distributed import torch_threads
from tasks.common import DECKS, SMALL, TASK, TRACKED
from tasks.data import by_content
from tasks.train import IGNORED, train_job

log = logging.getLogger(__name__)

register(
    StudyConfig,
    ScalingConfig,
    PointSpec,
    ScalingPoint,
    PowerLawFit,
    Knee,
    Bound,
    Efficiency,
    WorkerAdvice,
    StudyResult,
    StudySummary,
)


class Subset(NamedTuple):
    original: ContentShards
    augmented: ContentShards


class PointTasks(PinnedImageResolver):
    """Finds a study's training task where it runs: the tasks are made on demand, one per worker
    count (`training_task`), so a pod makes the one it was sent to run, by its name."""

    def load_task(self, loader_args: list[str]):
        match = re.fullmatch(r"train_point_(\d+)w", loader_args[3])  # ["task-module", m, "task-name", name]
        return training_task(int(match.group(1))) if match else super().load_task(loader_args)


point_tasks = PointTasks()


def _measure(
    spec: PointSpec,
    weights_path: str,
    original: Shards,
    val: Shards,
    info: DatasetInfo,
    model_cfg: ModelConfig,
    objective_cfg: ObjectiveConfig,
    **measured,
) -> ScalingPoint:
    """A point's val and train metric (eval mode, unaugmented rows, through the objective: a
    classifier's error, anyone else's loss) and its size."""
    goal = objectives.of(objective_cfg)
    model = load_state(build_model(model_cfg, info), weights_path)
    own = measure(model, batches(original, info), goal)
    held_out = measure(model, batches(val, info), goal)
    return replace_point(
        spec,
        train_rows=original.rows,
        parameters=sum(p.numel() for p in model.parameters()),
        val_metric=held_out.value,
        train_metric=own.value,
        metric=metric_of(goal),
        val_noise=held_out.noise,
        val_rows=val.rows,
        unit=unit_of(goal),
        train_units=own.count,
        **measured,
    )


@functools.cache
def training_task(workers: int):
    """The study's training task for `workers` processes on one node (a task cannot change its
    process count while it runs): the pipeline's training job, then, on rank 0, what the point
    measured. Its name is train_point_<workers>w."""

    def body(
        spec: PointSpec,
        train: Shards,
        original: Shards,
        val: Shards,
        info: DatasetInfo,
        model_cfg: ModelConfig,
        cfg: TrainConfig,
        fingerprint: DataFingerprint,
        started: TaskRun,
        mlflow_cfg: MlflowConfig,
        recovery: RecoveryConfig,
        threads: int,
        augment: AugmentConfig = AugmentConfig(),  # noqa: B008 (typed examples: each batch as it is drawn)
        objective: ObjectiveConfig = ObjectiveConfig(),  # noqa: B008 (a Flyte input's default is its value)
    ) -> ScalingPoint:
        run = TaskRun.start(f"train_point_{workers}w")
        trained = train_job(
            train, val, info, model_cfg, cfg, fingerprint, started, mlflow_cfg, recovery, threads, augment, objective
        )
        if trained is None:
            return None  # type: ignore[return-value]  # not rank 0: only rank 0's outputs are the task's
        history = trained.history
        median, low, high = throughput([e.samples_per_s for e in history.epochs])
        with torch_threads(threads):
            return _measure(
                spec,
                trained.path,
                original,
                val,
                info,
                model_cfg,
                objective,
                samples_per_s=median,
                samples_per_s_low=low,
                samples_per_s_high=high,
                train_seconds=run.done().seconds,
                epochs=len(history.epochs),
                mlflow_run_id=history.mlflow_run_id,
                trained_at=run.started_at,
                diagnosis=history.diagnosis,
            )

    body.__name__ = body.__qualname__ = f"train_point_{workers}w"  # the task's name: tasks.scaling.train_point_2w
    return task(
        # One node of `workers` torch-elastic processes, whatever launcher the pipeline registers
        # with: the study's worker count is its own, not FLYSCALE_NNODES x FLYSCALE_NPROC_PER_NODE.
        task_config=elastic_launcher(1, workers, settings.MAX_RESTARTS.integer(0)),
        # As train_model's, with this task's own launcher. `threads` stays in the key: it sets the
        # throughput the point measures.
        cache=code_cache(
            "models",
            "strategies",
            facts={"launcher": lambda: f"elastic:nnodes=1:nproc_per_node={workers}"},
            ignored_inputs=IGNORED,
        ),
        **{**TRACKED, "task_resolver": point_tasks},
        **resources.CLUSTER.training.task_kwargs(workers),  # per worker process, times the workers
        interruptible=True,
        retries=training_retries(),
        enable_deck=True,
        deck_fields=DECKS,
    )(body)


@task(cache=False, **TASK, requests=SMALL)
def data_pipeline(cfg: StudyConfig) -> PipelineConfig:
    """The config the pipeline's data branch prepares the study's data with (StudyConfig.data_pipeline)."""
    return cfg.data_pipeline()


@task(cache=code_cache("augmentations"), **TASK, requests=SMALL)
def subset_train(train: Shards, info: DatasetInfo, augment_cfg: AugmentConfig, fraction: float, seed: int) -> Subset:
    """A nested, stratified `fraction` of a table's training rows, as they are and augmented."""
    frame = shards.read(train.dir.download())
    rows = frame.iloc[nested_subset(frame[info.label_column].to_numpy(), fraction, seed)].reset_index(drop=True)
    return Subset(shards.write(rows, "subset"), shards.write(augment(rows, info, augment_cfg), "train"))


@task(cache=code_cache(), **TASK, requests=SMALL)
def subset_examples(train: Shards, info: DatasetInfo, fraction: float, seed: int) -> Subset:
    """A nested `fraction` of typed examples or token sequences, stratified by class where the
    label is one. Their augmentation happens as batches are drawn, so both halves are the same
    shards. Read and written as Arrow: a field's fixed-size lists stay what they are."""
    table = shards.read_table(train.dir.download())
    classes = info.label_column and fields.real_target(info) is None
    labels = table.column(info.label_column).to_numpy() if classes else np.zeros(table.num_rows)
    writer = shards.ShardWriter("subset")
    writer.write(table.take(nested_subset(labels, fraction, seed)))
    subset = writer.close()
    return Subset(subset, subset)


def point_execution(execution: str, spec: PointSpec) -> str:
    """Each point's own execution key. Training's live MLflow run and its checkpoint directory are
    found by it, so points never continue each other's runs or resume each other's checkpoints."""
    return f"{execution}/{spec.key}"


def study_mlflow(cfg: StudyConfig) -> MlflowConfig:
    return dataclasses.replace(cfg.mlflow, experiment=cfg.scaling.experiment)


@dynamic(**TASK, requests=SMALL)
def run_study(
    cfg: StudyConfig, train: Shards, val: Shards, info: DatasetInfo, fingerprint: DataFingerprint, started: TaskRun
) -> list[ScalingPoint]:
    """Every point of the plan as an ordinary cached training run, and what it measured."""
    specs = plan(cfg.scaling)
    seed = cfg.scaling.seed
    train, val = by_content(train=train, val=val)  # keyed by content again, not by where they were written
    subsets = {
        f: subset_examples(train=train, info=info, fraction=f, seed=seed)
        if info.fields
        else subset_train(train=train, info=info, augment_cfg=cfg.augment, fraction=f, seed=seed)
        for f in sorted({s.data_fraction for s in specs})
    }
    points = []
    for spec in specs:
        original, augmented = subsets[spec.data_fraction]
        stamp = dataclasses.replace(started, execution=point_execution(started.execution, spec))
        points.append(
            training_task(spec.workers)(
                spec=spec,
                train=augmented,
                original=original,
                val=val,
                info=info,
                model_cfg=spec_model(cfg.model, spec),
                cfg=cfg.train,
                fingerprint=fingerprint,
                started=stamp,
                mlflow_cfg=study_mlflow(cfg),
                recovery=cfg.recovery,
                threads=cfg.scaling.threads_per_worker,
                # Typed examples are augmented as batches are drawn; a table's subset already is.
                augment=cfg.augment if info.fields else AugmentConfig(),
                objective=cfg.objective,
            )
        )
    return points


# Cached like registration: the same points sent to the same store are logged once.
@task(
    cache=code_cache(
        facts={"mlflow_store": tracking_uri},
        libraries=(*LIBRARIES, "mlflow", "matplotlib"),
        ignored_inputs=("started",),
    ),
    **TRACKED,
    requests=SMALL,
    enable_deck=True,
    deck_fields=DECKS,
)
def report_study(cfg: StudyConfig, points: list[ScalingPoint], started: TaskRun) -> StudySummary:
    """Fits and recommendations; the "Scaling study" Deck; one MLflow parent run, a child per point."""
    result = analyse(points, cfg.scaling)
    with tempfile.TemporaryDirectory() as tmp:
        figures = plot_study(result, cfg.scaling, tmp)
        Deck("Scaling study", html_page(result, figures))
        summary = log_study(cfg, study_mlflow(cfg), result, figures, started)
    for line in result.lines():
        log.info("%s", line)
    return summary


@task(cache=False, **TASK, requests=SMALL)
def summarize_study(summary: StudySummary, started: TaskRun) -> StudySummary:
    """The summary, with which points this execution trained and which came from the cache."""
    fresh = {p.key for p in summary.result.points if p.trained_at >= started.started_at}
    summary.trained = sorted(fresh)
    summary.cached = sorted(p.key for p in summary.result.points if p.key not in fresh)
    return summary


@task(cache=False, **TRACKED, requests=SMALL)
def close_failed_study(cfg: StudyConfig, err: FlyteError | None = None) -> None:
    """The workflow's failure handler: the points' live MLflow runs this execution left RUNNING
    end FAILED, with the error beside them."""
    message = err.message if err is not None else "the execution failed"
    for spec in plan(cfg.scaling):
        close_failed_runs(study_mlflow(cfg), point_execution(execution_key(), spec), message)
