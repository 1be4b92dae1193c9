"""A scaling study's record: its Deck (the recommendations, the plots, every point) and one
MLflow parent run with a child run per point."""

from __future__ import annotations

import dataclasses
import html
import json
import time

from flyscale.config import (
    MlflowConfig,
    flatten,
)
from flyscale.flyte.provenance import TaskRun
from flyscale.scaling.advice import StudyResult, StudySummary
from flyscale.scaling.config import StudyConfig
from flyscale.scaling.plan import ScalingPoint, size_of
from flyscale.tracking import store as mlflow_store
from flyscale.tracking.store import EXECUTION_TAG


def _png(path: str) -> str:
    import base64

    with open(path, "rb") as f:
        return base64.b64encode(f.read()).decode("ascii")


def html_page(result: StudyResult, figures: dict[str, str]) -> str:
    """The "Scaling study" Deck: the recommendations with their numbers, the plots, every point."""
    lines = "".join(f"<li>{html.escape(line)}</li>" for line in result.lines())
    metric, noun = result.metric, result.data_noun
    rows = "".join(
        f"<tr><td>{html.escape(p.key)}</td><td>{size_of(p, 'data'):,.0f}</td><td>{p.parameters:,}</td>"
        f"<td>{p.workers}</td><td>{p.val_metric:.4f} &plusmn; {p.val_noise:.4f}</td><td>{p.train_metric:.4f}</td>"
        f"<td>{p.gap:+.4f}</td><td>{p.samples_per_s:,.0f}</td></tr>"
        for p in sorted(result.points, key=lambda p: p.key)
    )
    return (
        f"<h3>Scaling study</h3><ul>{lines}</ul>"
        f'<img alt="scaling study" src="data:image/png;base64,{_png(figures["scaling.png"])}"/>'
        f"<table><thead><tr><th>point</th><th>{noun}</th><th>parameters</th><th>workers</th><th>val {metric}</th>"
        f"<th>train {metric}</th><th>gap</th><th>samples/s</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def _batches(items: list, size: int = 100):
    """MLflow takes at most 100 params (and 1000 metrics) a request."""
    return [items[i : i + size] for i in range(0, len(items), size)]


def _point_values(p: ScalingPoint) -> tuple[dict[str, float], dict[str, str]]:
    # Named apart from the epoch curves training logged to the same run (val_accuracy, samples_per_s).
    metrics = {
        f"point_val_{p.metric}": p.val_metric,
        f"point_val_{p.metric}_stderr": p.val_noise,
        f"point_train_{p.metric}": p.train_metric,
        "point_train_val_gap": p.gap,
        "point_parameters": p.parameters,
        "point_train_rows": p.train_rows,
        **({f"point_train_{p.unit}s": p.train_units} if p.unit != "example" else {}),
        "point_samples_per_s": p.samples_per_s,
        "point_train_seconds": p.train_seconds,
    }
    params = {
        "data_fraction": p.data_fraction,
        "width_multiplier": p.width_multiplier,
        "depth_multiplier": p.depth_multiplier,
        "workers": p.workers,
        "axes": ",".join(p.axes),
        "epochs": p.epochs,
    }
    return metrics, {k: str(v) for k, v in params.items()}


def _log_point(client, experiment: str, parent: str, p: ScalingPoint, started: TaskRun) -> str:
    """A point as a child run of the study: the live run its training opened when this execution
    trained it (its epoch curves are there), else a new run that names the run it was trained in."""
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.exceptions import MlflowException

    metrics, params = _point_values(p)
    run = None
    if p.mlflow_run_id:
        try:
            run = client.get_run(p.mlflow_run_id)
        except MlflowException:
            run = None
    # RUNNING: trained in this execution. Finished: a cached point, already a child of an earlier study.
    adopt = run is not None and run.info.status == "RUNNING" and run.info.experiment_id == experiment
    tags = {
        "mlflow.parentRunId": parent,
        "flyscale.scaling.point": p.key,
        "flyscale.scaling.trained": "in this execution" if adopt else f"cached: trained in run {p.mlflow_run_id}",
    }
    if run is not None and adopt:
        run_id = run.info.run_id
        client.update_run(run_id, name=p.key)
    else:
        run_id = client.create_run(
            experiment,
            start_time=int(started.started_at * 1000),
            run_name=p.key,
            tags={EXECUTION_TAG: started.execution},
        ).info.run_id
    now = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
        params=[Param(k, v) for k, v in params.items()],
        tags=[RunTag(k, v) for k, v in tags.items()],
    )
    client.set_terminated(run_id, "FINISHED")
    return run_id


def _study_metrics(result: StudyResult) -> dict[str, float]:
    out: dict[str, float] = {"recommended_workers": result.workers.workers, "train_val_gap": result.bound.gap}
    for name, fit in (("data", result.data_fit), ("parameters", result.model_fit)):
        if fit.meaningful:
            out |= {
                f"{name}_fit_beta": fit.beta,
                f"{name}_fit_gamma": fit.gamma,
                f"{name}_fit_r2_log": fit.r2_log,
                f"{name}_doubling_drop": fit.drop,
                f"{name}_doubling_drop_low": fit.drop_low,
                f"{name}_doubling_drop_high": fit.drop_high,
            }
    knee_unit = result.data_noun.removeprefix("training ")
    for name, knee in ((f"data_knee_{knee_unit}", result.data_knee), ("model_knee_parameters", result.model_knee)):
        if knee.found:
            out[name] = knee.size
    return out


def log_study(
    cfg: StudyConfig, store: MlflowConfig, result: StudyResult, figures: dict[str, str], started: TaskRun
) -> StudySummary:
    """One parent run (config, fits, recommendations, plots, the points table) and a child per point."""
    import pandas as pd
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag

    with mlflow_store.client_settings(store):
        uri = mlflow_store.tracking_uri()
        client = MlflowClient(uri)
        experiment = mlflow_store.use_experiment(client, store.experiment)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(started.started_at))
        name = f"scaling-{cfg.model.name}-{cfg.data.dataset}-{stamp}"
        parent = client.create_run(
            experiment,
            start_time=int(started.started_at * 1000),
            run_name=name,
            tags={EXECUTION_TAG: started.execution, "flyscale.scaling": "study"},
        )
        parent = parent.info.run_id
        try:
            params = [Param(k, str(v)[: mlflow_store.MAX_PARAM_CHARS]) for k, v in flatten(cfg).items()]
            tags = {
                "flyscale.scaling.bound": result.bound.verdict,
                "flyscale.scaling.workers": result.workers.sentence,
                "flyscale.scaling.data_fit": result.data_fit.summary(),
                "flyscale.scaling.parameters_fit": result.model_fit.summary(),
            }
            now = int(time.time() * 1000)
            client.log_batch(
                parent,
                metrics=[Metric(k, float(v), now, 0) for k, v in _study_metrics(result).items()],
                tags=[RunTag(k, v) for k, v in tags.items()],
            )
            for chunk in _batches(params):
                client.log_batch(parent, params=chunk)
            for path in figures.values():
                client.log_artifact(parent, path, "plots")
            client.log_text(parent, "\n".join(result.lines()) + "\n", "recommendations.txt")
            client.log_text(parent, json.dumps(dataclasses.asdict(result), indent=1, default=float), "study.json")
            client.log_table(
                parent, pd.DataFrame([dataclasses.asdict(p) | {"gap": p.gap} for p in result.points]), "points.json"
            )
            for point in result.points:
                _log_point(client, experiment, parent, point, started)
        except BaseException:
            client.set_terminated(parent, "FAILED")
            raise
        client.set_terminated(parent, "FINISHED")
    return StudySummary(result, mlflow_store.shown(uri), experiment, parent)  # printed: no password
