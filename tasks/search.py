"""Hyperparameter-search stages. The study is a recursive @dynamic of rounds: each round asks
Optuna for `search.concurrency` trials, trains each with the pipeline's own cached training task
(on a cluster, a PyTorchJob each, side by side), and tells the study how they ended; trials report
every epoch to the study, which prunes those behind. The logic is flyscale/search/."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from flytekit import dynamic, task
from flytekit.types.error import FlyteError

from flyscale.cluster.launchers import local_execution
from flyscale.config import PipelineConfig
from flyscale.config.flatten import effective, flatten
from flyscale.data.shards import Shards
from flyscale.data.source import DataFingerprint
from flyscale.flyte.dataclass_types import register
from flyscale.flyte.provenance import TaskRun
from flyscale.plugin.records import DatasetInfo
from flyscale.render.summary import RunSummary
from flyscale.search import report, study
from flyscale.search.config import Param, SearchConfig, SearchStudyConfig
from flyscale.search.report import SearchSummary, Study
from flyscale.search.study import TrialResult, TrialSpec
from flyscale.tracking.live import close_failed_runs
from flyscale.train.preflight import PreflightReport
from flyscale.train.telemetry import TrainHistory
from tasks.common import SMALL, TASK, TRACKED
from tasks.data import by_content
from tasks.train import train_model

log = logging.getLogger(__name__)

register(SearchStudyConfig, SearchConfig, Param, Study, TrialResult, SearchSummary)


@task(cache=False, **TASK, requests=SMALL)
def base_config(cfg: SearchStudyConfig) -> PipelineConfig:
    """The pipeline config every trial starts from, which the data branch prepares the data with."""
    return cfg.base()


@task(cache=False, **TRACKED, requests=SMALL)
def open_study(cfg: SearchStudyConfig, started: TaskRun) -> Study:
    """A fresh Optuna study for this execution (a rerun asks the same trials, which the cache
    then replays) and its MLflow parent run."""
    name = f"{cfg.study_name()}@{started.execution or 'local'}-{int(started.started_at)}"
    storage = study.storage_url(cfg.search, Path.home() / ".flyscale" / "studies", local=local_execution())
    study.create(cfg, name, storage)
    opened = time.time()
    parent = report.open_parent(cfg, name, started.started_at)
    return Study(name, storage, parent, opened, storage_env=cfg.search.storage_env)


@dynamic(cache=False, **TASK, requests=SMALL)
def run_trials(
    cfg: SearchStudyConfig,
    at: Study,
    done: list[TrialResult],
    train: Shards,
    val: Shards,
    info: DatasetInfo,
    fingerprint: DataFingerprint,
    started: TaskRun,
    preflight: PreflightReport = PreflightReport.skipped(),  # noqa: B008 (a Flyte input's default is its value)
) -> list[TrialResult]:
    """One round: ask for the next trials, train each, tell the study; then the next round. Every
    trial trains on the workers the base config's preflight chose (FLYSCALE_NPROC_PER_NODE=auto)."""
    specs = study.ask(cfg, at.name, at.storage, cfg.search.concurrency, at.parent_run_id)
    if not specs:
        return done
    keyed = by_content(train=train, val=val)  # keyed by content again, not by where they were written
    histories, runs = [], []
    for spec in specs:
        trial = study.trial_config(cfg, spec)
        _, history, run = train_model(
            train=keyed.train,
            val=keyed.val,
            info=info,
            model_cfg=trial.model,
            cfg=trial.train,
            preflight=preflight,
            fingerprint=fingerprint,
            started=started,
            mlflow_cfg=trial.mlflow,
            recovery=trial.recovery,
            augment=trial.augment,
            objective=trial.objective,
            trial=spec,
            trial_key=spec.key(),
            workers=preflight.workers,
        )
        histories.append(history)
        runs.append(run)
    told = tell_trials(cfg=cfg, at=at, specs=specs, histories=histories, runs=runs, done=done, started=started)
    return run_trials(
        cfg=cfg,
        at=at,
        done=told,
        train=train,
        val=val,
        info=info,
        fingerprint=fingerprint,
        started=started,
        preflight=preflight,
    )


@task(cache=False, **TRACKED, requests=SMALL)
def tell_trials(
    cfg: SearchStudyConfig,
    at: Study,
    specs: list[TrialSpec],
    histories: list[TrainHistory],
    runs: list[TaskRun],
    done: list[TrialResult],
    started: TaskRun,
) -> list[TrialResult]:
    """Tell the study how the round's trials ended, and end each trial's child run of this study's
    parent run (FINISHED, its state a tag, its config as params); a trial the cache replayed gets
    one that says so."""
    opened = study.load(at.name, at.storage, at.storage_env, cfg.search)
    told = []
    for spec, history, run in zip(specs, histories, runs):
        replayed = run.cached(started.started_at)
        result = study.tell(opened, spec, history, replayed)
        ended = 0.0 if replayed else run.started_at + run.seconds
        result = dataclasses.replace(result, run_id=report.close_trial(cfg, at, result, history, ended))
        log.info("trial %d: %s %s = %.4f %s", result.number, result.state, cfg.search.metric, result.value, spec.params)
        told.append(result)
    return [*done, *told]


@task(cache=False, **TRACKED, requests=SMALL)
def best_config(cfg: SearchStudyConfig, at: Study, results: list[TrialResult]) -> PipelineConfig:
    """The best trial's config, which the training pipeline then takes through the gates and
    registers (no trial is registered on its own); the study's table and state go to MLflow."""
    best = study.best(results, cfg.search.direction)
    chosen = study.trial_config(cfg, TrialSpec(number=best.number, params=best.params))
    report.log_study(cfg, at, results, best, flatten(chosen))
    return chosen


@task(cache=False, **TRACKED, requests=SMALL)
def finish_search(cfg: SearchStudyConfig, at: Study, results: list[TrialResult], summary: RunSummary) -> SearchSummary:
    """The search's summary: every trial, the best, and what the pipeline made of it."""
    return report.finish(cfg, at, results, summary)


@task(cache=False, **TRACKED, requests=SMALL)
def close_failed_search(cfg: SearchStudyConfig, err: FlyteError | None = None) -> None:
    """The workflow's failure handler: the runs this execution left RUNNING end FAILED."""
    from flyscale.flyte.provenance import execution_key

    message = err.message if err is not None else "the search failed"
    base = cfg.base()
    close_failed_runs(cfg.mlflow, execution_key(), message, flatten(base), effective(base))
