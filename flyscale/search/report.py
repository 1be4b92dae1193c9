"""The study in MLflow: one parent run, a child run per trial (the trial's own training run, or,
for a trial the cache replayed, a run that says so), and at the end the trials' table, the best
trial and the study's Optuna storage as artifacts of the parent."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from flyscale.config.flatten import flatten
from flyscale.render.summary import RunSummary
from flyscale.search import study
from flyscale.search.config import SearchStudyConfig
from flyscale.search.study import PRUNED, TrialResult, TrialSpec
from flyscale.tracking.store import EXECUTION_TAG, MAX_PARAM_CHARS, client_settings, tracking_uri, use_experiment
from flyscale.train.telemetry import TrainHistory

PARENT_TAG = "flyscale.search"


@dataclass
class Study:
    """This execution's study: its Optuna name and storage, and its MLflow parent run."""

    name: str
    storage: str  # a password-free URL, or "" when storage_env names the variable holding it
    parent_run_id: str
    opened_at: float = 0.0  # unix seconds: the search's own time runs from here to the best trial's choice
    storage_env: str = ""  # search.storage_env: only the name travels, the tasks read its value


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


# How a trial ended, on its child run. MLflow has no "pruned" status: a pruned trial's run is
# FINISHED (its training ended as the search decided) with this tag saying "pruned", as Optuna's
# own MLflow callback does. KILLED would read as a run someone stopped, and the UI's status
# filter would hide pruned trials among crashed ones; the compare view treats every status alike.
STATE_TAG = "flyscale.trial_state"


def close_trial(
    cfg: SearchStudyConfig, at: Study, result: TrialResult, history: TrainHistory, ended_at: float = 0.0
) -> str:
    """End a trial's child run as any run ends, so the compare view can set trials side by side:
    FINISHED, named by its values (`trial-03 lr=0.00312 hidden=[128]`), its state in the tag
    `flyscale.trial_state` (complete or pruned), and as params the whole effective config it
    trained (`train.lr`, `model.options.hidden`, ...) and its sampled values (`trial.train.lr`).
    The run is the trial's own training run; a trial whose training the cache replayed (or that
    could not reach MLflow as it trained) gets a new one, with its epochs' metrics and the run that
    trained it. `ended_at` (unix seconds): when its training ended. The run's id."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    name = study.run_name(result.number, result.params)
    config = flatten(study.trial_config(cfg, TrialSpec(number=result.number, params=result.params)))
    params = {**{k: _param_text(v) for k, v in config.items()}, **{f"trial.{k}": v for k, v in result.params.items()}}
    tags = {STATE_TAG: result.state, "flyscale.trial": str(result.number), "mlflow.parentRunId": at.parent_run_id}
    if result.stopping:
        tags["flyscale.stopping"] = result.stopping[:MAX_PARAM_CHARS]
    with client_settings(cfg.mlflow):
        client = MlflowClient(tracking_uri())
        run_id = "" if result.replayed else history.mlflow_run_id
        metrics = []
        if not run_id:
            experiment = use_experiment(client, cfg.mlflow.experiment)
            if result.replayed:
                name, tags["flyscale.replayed_from"] = f"{name} (replayed)", history.mlflow_run_id
            run_id = client.create_run(experiment, run_name=name, tags=tags).info.run_id
            metrics = [
                Metric(k, float(v), 0, m.epoch)
                for m in history.epochs
                for k, v in m.per_epoch().items()
                if v is not None
            ]
        else:
            client.update_run(run_id, name=name)
            for key, value in tags.items():
                client.set_tag(run_id, key, value)
        logged = client.get_run(run_id).data.params  # a param once logged cannot change
        fresh = [Param(k, v) for k, v in params.items() if k not in logged]
        for at_param in range(0, len(fresh), 100):  # MLflow takes at most 100 params a batch
            client.log_batch(run_id, params=fresh[at_param : at_param + 100])
        for at_metric in range(0, len(metrics), 1000):  # and 1000 metrics
            client.log_batch(run_id, metrics=metrics[at_metric : at_metric + 1000])
        client.set_terminated(run_id, "FINISHED", end_time=int(ended_at * 1000) if ended_at else None)
    return run_id


def _param_text(value: object) -> str:
    """A config value as the pipeline's runs log it: its text, cut only past MLflow's limit."""
    text = str(value)
    return text if len(text) <= MAX_PARAM_CHARS else text[: MAX_PARAM_CHARS - 40] + " ... (cut: see config.yaml)"


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
