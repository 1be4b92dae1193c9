"""Registration stage: one MLflow run per pipeline execution, with both models. The workflow
branches on the gates: `register_model` when every gate passed (versions registered, the alias
moved by compare-and-set), `record_candidate` when one failed (the run and its models logged,
no version). Then the summary of what this execution computed and what it took from the cache."""

from __future__ import annotations

from typing import NamedTuple, Optional

from flytekit import task
from flytekit.types.directory import FlyteDirectory
from flytekit.types.error import FlyteError
from flytekit.types.file import FlyteFile

from flyscale import registration, tracking
from flyscale.caching import LIBRARIES, code_cache
from flyscale.comparison import Comparison
from flyscale.config import PipelineConfig
from flyscale.contracts import DatasetInfo
from flyscale.data import DataFingerprint
from flyscale.evaluation import EvalMetrics
from flyscale.gating import Judgment
from flyscale.preflight import PreflightReport
from flyscale.provenance import CacheReport, TaskRun, execution_key
from flyscale.shards import Shards
from flyscale.summary import RunSummary
from flyscale.training import TrainHistory
from flyscale.validation import Profile, ValidationReport
from tasks.common import SMALL, TASK

Registered = NamedTuple("Registered", [("summary", RunSummary), ("run", TaskRun)])

# The MLflow store is part of the version: the same inputs sent to another store register again.
# The stamps of earlier tasks only describe this execution, so they are not part of the key.
REGISTER_CACHE = code_cache(
    "models", "quantizers", facts={"mlflow_store": tracking.tracking_uri}, libraries=(*LIBRARIES, "mlflow"),
    ignored_inputs=("runs", "data_runs", "started"),
)


def _log(publish: bool, name: str, cfg: PipelineConfig, info: DatasetInfo, fingerprint: DataFingerprint,
         report: ValidationReport, quarantined: Shards, profile: Profile, report_files: FlyteDirectory,
         history: TrainHistory, preflight: PreflightReport, weights: FlyteFile, fp32: EvalMetrics, test_sha256: str,
         judgment: Judgment, int8_weights: FlyteFile, int8: EvalMetrics, comparison: Comparison, plots: FlyteDirectory,
         runs: list[TaskRun], data_runs: list[TaskRun], started: TaskRun) -> Registered:
    run = TaskRun.start(name)
    summary = registration.register(
        cfg, info, fingerprint, report, quarantined.dir.download(), profile, report_files.download(), history,
        preflight, weights.download(), fp32, test_sha256, judgment, int8_weights.download(), int8, comparison,
        plots.download(), [*data_runs, *runs], started, publish=publish,
    )
    return Registered(summary=summary, run=run.done())


@task(cache=REGISTER_CACHE, **TASK, requests=SMALL)
def register_model(
    cfg: PipelineConfig, info: DatasetInfo, fingerprint: DataFingerprint, report: ValidationReport,
    quarantined: Shards, profile: Profile, report_files: FlyteDirectory, history: TrainHistory,
    preflight: PreflightReport, weights: FlyteFile, fp32: EvalMetrics, test_sha256: str, judgment: Judgment,
    int8_weights: FlyteFile, int8: EvalMetrics, comparison: Comparison, plots: FlyteDirectory,
    runs: list[TaskRun], data_runs: list[TaskRun], started: TaskRun,
) -> Registered:
    """Every gate passed: log the run, register both models, move the alias (compare-and-set)."""
    return _log(True, "register_model", cfg, info, fingerprint, report, quarantined, profile, report_files, history,
                preflight, weights, fp32, test_sha256, judgment, int8_weights, int8, comparison, plots, runs, data_runs,
                started)


@task(cache=REGISTER_CACHE, **TASK, requests=SMALL)
def record_candidate(
    cfg: PipelineConfig, info: DatasetInfo, fingerprint: DataFingerprint, report: ValidationReport,
    quarantined: Shards, profile: Profile, report_files: FlyteDirectory, history: TrainHistory,
    preflight: PreflightReport, weights: FlyteFile, fp32: EvalMetrics, test_sha256: str, judgment: Judgment,
    int8_weights: FlyteFile, int8: EvalMetrics, comparison: Comparison, plots: FlyteDirectory,
    runs: list[TaskRun], data_runs: list[TaskRun], started: TaskRun,
) -> Registered:
    """A gate failed: log the run and both models (LoggedModels), register no version."""
    return _log(False, "record_candidate", cfg, info, fingerprint, report, quarantined, profile, report_files,
                history, preflight, weights, fp32, test_sha256, judgment, int8_weights, int8, comparison, plots,
                runs, data_runs, started)


@task(cache=False, **TASK, requests=SMALL)
def summarize(
    summary: RunSummary, runs: list[TaskRun], data_runs: list[TaskRun], register_run: TaskRun, started: TaskRun
) -> RunSummary:
    """The run summary, with which tasks this execution ran and which it took from the cache."""
    summary.cache = CacheReport.of([*data_runs, *runs, register_run], started.started_at, registration.ALWAYS_RUN)
    return summary


@task(cache=False, **TASK, requests=SMALL)
def close_failed_run(cfg: PipelineConfig, err: Optional[FlyteError] = None) -> None:
    """The workflow's failure handler: the MLflow run this execution left RUNNING ends FAILED,
    with the error beside it. (Flyte runs it with the workflow's inputs when any task fails.)"""
    message = err.message if err is not None else "the execution failed"
    where = f" (in {err.failed_node_id})" if err is not None and err.failed_node_id else ""
    tracking.close_failed_runs(cfg.mlflow, execution_key(), message + where)
