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

from flytekit import Deck, dynamic, task
from flytekit.types.error import FlyteError
from pandera.typing import DataFrame

from flyscale import settings
from flyscale.cluster import resources
from flyscale.cluster.image import PinnedImageResolver
from flyscale.cluster.launchers import elastic_launcher, training_retries
from flyscale.config import (
    AugmentConfig,
    MlflowConfig,
    ModelConfig,
    RecoveryConfig,
    TrainConfig,
)
from flyscale.data import shards
from flyscale.data.augment import augment
from flyscale.data.schemas import LabeledFrame
from flyscale.data.shards import Shards
from flyscale.data.source import DataFingerprint
from flyscale.data.tensors import batches, to_tensors
from flyscale.evaluate.metrics import evaluate, evaluate_batches
from flyscale.flyte.caching import LIBRARIES, code_cache
from flyscale.flyte.dataclass_types import register
from flyscale.flyte.provenance import TaskRun, execution_key
from flyscale.model import build_model, load_state
from flyscale.plugin.contracts import DatasetInfo, ObjectiveContext
from flyscale.scaling.advice import (
    Bound,
    Efficiency,
    Knee,
    StudyResult,
    StudySummary,
    WorkerAdvice,
    analyse,
)
from flyscale.scaling.config import ScalingConfig, StudyConfig
from flyscale.scaling.laws import PowerLawFit
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
from flyscale.tracking.live import close_failed_runs
from flyscale.tracking.store import tracking_uri
from flyscale.train import objective as objectives
from flyscale.train.distributed import torch_threads
from tasks.common import DECKS, SMALL, TASK, task_options
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
    original: Shards
    augmented: Shards


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
    **measured,
) -> ScalingPoint:
    """A point's val and train error (eval mode, unaugmented rows) and its size."""
    model = load_state(build_model(model_cfg, info), weights_path)
    rows = shards.read(original.dir.download(), [*info.feature_columns, info.label_column])
    own = evaluate(model, *to_tensors(rows, info), info.num_classes)
    held_out = evaluate_batches(model, batches(val, info), objectives.default(), ObjectiveContext(info))
    return replace_point(
        spec,
        train_rows=original.rows,
        parameters=sum(p.numel() for p in model.parameters()),
        val_error=1.0 - held_out.accuracy,
        train_error=1.0 - own.accuracy,
        val_rows=val.rows,
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
    ) -> ScalingPoint:
        run = TaskRun.start(f"train_point_{workers}w")
        trained = train_job(train, val, info, model_cfg, cfg, fingerprint, started, mlflow_cfg, recovery, threads)
        if trained is None:
            return None  # type: ignore[return-value]  # not rank 0: only rank 0's outputs are the task's
        history = trained.history
        median, low, high = throughput([e.samples_per_s for e in history.epochs])
        with torch_threads(threads):
            return _measure(
                spec,
                trained.weights.path,
                original,
                val,
                info,
                model_cfg,
                samples_per_s=median,
                samples_per_s_low=low,
                samples_per_s_high=high,
                train_seconds=run.done().seconds,
                epochs=len(history.epochs),
                mlflow_run_id=history.mlflow_run_id,
                trained_at=run.started_at,
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
        **{**task_options(), "task_resolver": point_tasks},
        **resources.CLUSTER.training.task_kwargs(workers),  # per worker process, times the workers
        interruptible=True,
        retries=training_retries(),
        enable_deck=True,
        deck_fields=DECKS,
    )(body)


@task(cache=code_cache(), **TASK, requests=SMALL)
def train_rows(train: DataFrame[LabeledFrame]) -> Shards:
    """The training split as shards: what the study subsets (a frame would be uploaded afresh by
    the dynamic study, under a new name each time, and miss the cache of everything after it)."""
    return shards.write(train, "train-rows")


@task(cache=code_cache("augmentations"), **TASK, requests=SMALL)
def subset_train(train: Shards, info: DatasetInfo, augment_cfg: AugmentConfig, fraction: float, seed: int) -> Subset:
    """A nested, stratified `fraction` of the training rows, as they are and augmented."""
    frame = shards.read(train.dir.download())
    rows = frame.iloc[nested_subset(frame[info.label_column].to_numpy(), fraction, seed)].reset_index(drop=True)
    return Subset(shards.write(rows, "subset"), shards.write(augment(rows, info, augment_cfg), "train"))


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
    subsets = {
        f: subset_train(train=train, info=info, augment_cfg=cfg.augment, fraction=f, seed=cfg.scaling.seed)
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
    **TASK,
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


@task(cache=False, **TASK, requests=SMALL)
def close_failed_study(cfg: StudyConfig, err: FlyteError | None = None) -> None:
    """The workflow's failure handler: the points' live MLflow runs this execution left RUNNING
    end FAILED, with the error beside them."""
    message = err.message if err is not None else "the execution failed"
    for spec in plan(cfg.scaling):
        close_failed_runs(study_mlflow(cfg), point_execution(execution_key(), spec), message)
