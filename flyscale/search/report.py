"""The study in MLflow: one parent run, a child run per trial (the trial's own training run, or,
for a trial the cache replayed, a run that says so), and at the end the trials' table, the best
trial and the study's Optuna storage as artifacts of the parent."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from flyscale.render.summary import RunSummary
from flyscale.search import study
from flyscale.search.config import SearchStudyConfig
from flyscale.search.study import PRUNED, TrialResult
from flyscale.tracking.store import EXECUTION_TAG, client_settings, tracking_uri, use_experiment
from flyscale.train.telemetry import TrainHistory

PARENT_TAG = "flyscale.search"


@dataclass
class Study:
    """This execution's study: its Optuna name and storage, and its MLflow parent run."""

    name: str
    storage: str
    parent_run_id: str
    opened_at: float = 0.0  # unix seconds: the search's own time runs from here to the best trial's choice


@dataclass
class SearchSummary:
    study: str
    metric: str
    direction: str
    parent_run_id: str
    trials: list[TrialResult] = field(default_factory=list)
    best: int = -1  # the best trial's number
    pipeline: str = ""  # the summary of the pipeline run of the best trial's config

    def __str__(self) -> str:
        lines = ["", "flyscale search summary", f"  study       {self.study} ({self.direction} {self.metric})"]
        for r in self.trials:
            mark = "*" if r.number == self.best else " "
            how = " (from the cache)" if r.replayed else ""
            params = ", ".join(f"{k}={v}" for k, v in r.params.items())
            lines.append(
                f"  trial {r.number:>3}{mark} {r.state:<8} {self.metric} {r.value:.4f}  {r.epochs} epochs "
                f"{r.seconds:5.1f} s  {params}{how}"
            )
        pruned = sum(r.state == PRUNED for r in self.trials)
        lines.append(f"  trials      {len(self.trials)}: {len(self.trials) - pruned} finished, {pruned} pruned")
        lines.append(f"  best        trial {self.best}; its config went through the pipeline once:")
        lines.append(f"  mlflow      parent run {self.parent_run_id}")
        return "\n".join(lines) + "\n" + self.pipeline

    __repr__ = __str__


def open_parent(cfg: SearchStudyConfig, name: str, started_at: float) -> str:
    """The study's MLflow parent run, RUNNING until the search ends; its id."""
    from mlflow import MlflowClient

    from flyscale.flyte.provenance import execution_key

    with client_settings(cfg.mlflow):
        client = MlflowClient(tracking_uri())
        experiment = use_experiment(client, cfg.mlflow.experiment)
        run = client.create_run(
            experiment,
            start_time=int(started_at * 1000),
            run_name=f"search {name}",
            tags={PARENT_TAG: name, EXECUTION_TAG: execution_key()},
        )
        search = cfg.search
        client.log_dict(run.info.run_id, json.loads(json.dumps(_space(cfg))), "search/space.json")
        for key, value in (
            ("search.trials", search.trials),
            ("search.concurrency", search.concurrency),
            ("search.metric", search.metric),
            ("search.sampler", search.sampler),
            ("search.pruner", search.pruner),
            ("search.seed", search.seed),
        ):
            client.log_param(run.info.run_id, key, value)
    return run.info.run_id


def replayed_child(cfg: SearchStudyConfig, at: Study, result: TrialResult, history: TrainHistory) -> str:
    """A child run for a trial whose training the cache replayed: its values, its epochs' metrics
    and the run that trained it. Its id."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    with client_settings(cfg.mlflow):
        client = MlflowClient(tracking_uri())
        experiment = use_experiment(client, cfg.mlflow.experiment)
        run = client.create_run(
            experiment,
            run_name=f"trial {result.number} (replayed)",
            tags={
                "mlflow.parentRunId": at.parent_run_id,
                "flyscale.trial": str(result.number),
                "flyscale.replayed_from": history.mlflow_run_id,
            },
        )
        metrics = [
            Metric(k, float(v), 0, m.epoch) for m in history.epochs for k, v in m.per_epoch().items() if v is not None
        ]
        params = [Param(f"trial.{k}", v) for k, v in result.params.items()]
        client.log_batch(run.info.run_id, metrics=metrics[:1000], params=params)
        client.set_terminated(run.info.run_id)
    return run.info.run_id


def log_study(cfg: SearchStudyConfig, at: Study, results: list[TrialResult], best: TrialResult, chosen: dict) -> None:
    """The trials' table, the best trial and the study's storage, on the parent run."""
    import pandas as pd
    from mlflow import MlflowClient

    with client_settings(cfg.mlflow):
        client = MlflowClient(tracking_uri())
        run_id = at.parent_run_id
        rows = [
            {
                "trial": r.number,
                "state": r.state,
                cfg.search.metric: r.value,
                "epochs": r.epochs,
                "run_id": r.run_id,
                "replayed": r.replayed,
                **r.params,
            }
            for r in results
        ]
        client.log_table(run_id, pd.DataFrame(rows), "search/trials.json")
        client.log_dict(run_id, chosen, "search/best_config.json")
        client.log_metric(run_id, f"best_{cfg.search.metric}", best.value)
        client.log_metric(run_id, "trials_pruned", sum(r.state == PRUNED for r in results))
        # The search's overhead: its wall time against the time its trials spent training (their epochs).
        client.log_metric(run_id, "search_seconds", time.time() - at.opened_at)
        client.log_metric(run_id, "trials_train_seconds", sum(r.seconds for r in results if not r.replayed))
        client.set_tag(run_id, "flyscale.best_trial", str(best.number))
        client.set_tag(run_id, "flyscale.best_params", json.dumps(best.params)[:5000])
        if at.storage.startswith("sqlite:///"):  # the study itself, for optuna.load_study later
            client.log_artifact(run_id, at.storage.removeprefix("sqlite:///"), "search")


def finish(cfg: SearchStudyConfig, at: Study, results: list[TrialResult], summary: RunSummary) -> SearchSummary:
    """The search summary; the pipeline run of the best config becomes a child of the parent, which ends."""
    from mlflow import MlflowClient

    best = study.best(results, cfg.search.direction)
    with client_settings(cfg.mlflow):
        client = MlflowClient(tracking_uri())
        final = summary.registration.run_id
        # The pipeline run of the best config is a child of the study, unless it is an earlier
        # execution's that the cache replayed, which stays its own study's.
        if final and "mlflow.parentRunId" not in client.get_run(final).data.tags:
            client.set_tag(final, "mlflow.parentRunId", at.parent_run_id)
            client.set_tag(final, "flyscale.search_best_of", at.name)
        if final:
            client.set_tag(at.parent_run_id, "flyscale.pipeline_run", final)
        client.set_terminated(at.parent_run_id)
    return SearchSummary(
        at.name, cfg.search.metric, cfg.search.direction, at.parent_run_id, results, best.number, str(summary)
    )


def _space(cfg: SearchStudyConfig) -> dict:
    return {
        path: {k: v for k, v in vars(p).items() if v is not None and not k.startswith("_")}
        for path, p in cfg.search.space.items()
    }
