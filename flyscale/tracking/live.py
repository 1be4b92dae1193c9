"""The execution's MLflow run before it is published: rank 0 logs every epoch to it as the epoch
ends, rejected data leaves its quarantine in it, and the workflow's failure handler ends the runs
a failed execution left RUNNING (with their params and config)."""

from __future__ import annotations

import logging
import time

from flyscale.config import MlflowConfig
from flyscale.flyte import outputs
from flyscale.tracking.store import (
    EXECUTION_TAG,
    MAX_PARAM_CHARS,
    client_settings,
    tracking_uri,
    use_experiment,
)

log = logging.getLogger(__name__)


class LiveRun:
    """The execution's MLflow run, opened by training's rank 0, which logs every epoch to it as
    the epoch ends, so the curves grow in the UI while training runs. Best effort: MLflow being
    away costs the live curves (registration logs them afterwards), never the training."""

    def __init__(
        self, cfg: MlflowConfig, name: str, started_at: float, execution: str, tags: dict[str, str] | None = None
    ):
        """`tags` set on the run, and told apart by: a search's trials share one execution, and
        each is a child run of the study's (mlflow.parentRunId)."""
        self.run_id, self._client = "", None
        try:
            from mlflow import MlflowClient

            with client_settings(cfg):
                client = MlflowClient(tracking_uri())
                experiment = use_experiment(client, cfg.experiment)
                # A restarted worker group or a retried task carries on with the run it had opened.
                earlier = client.search_runs(
                    [experiment],
                    max_results=1,
                    filter_string=f"tags.`{EXECUTION_TAG}` = '{execution}' and tags.`flyscale.live` = 'training' "
                    f"and attributes.status = 'RUNNING' and attributes.start_time = {int(started_at * 1000)}"
                    + "".join(f" and tags.`{k}` = '{v}'" for k, v in (tags or {}).items()),
                )
                # The execution tag lets the workflow's failure handler find and close this run.
                run = (
                    earlier[0]
                    if earlier
                    else client.create_run(
                        experiment,
                        start_time=int(started_at * 1000),
                        run_name=name,
                        tags={"flyscale.live": "training", EXECUTION_TAG: execution, **(tags or {})},
                    )
                )
            self.run_id, self._client, self._cfg = run.info.run_id, client, cfg
            log.info(
                "training curves live in MLflow: run %s (%s)%s", self.run_id, name, " (continued)" if earlier else ""
            )
        except Exception as exc:  # noqa: BLE001 (any failure of the store: train on, log later)
            log.warning("MLflow is not reachable for live training curves (%s); they are logged at registration", exc)

    def epoch(self, m) -> None:
        if self._client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, m.epoch) for k, v in m.per_epoch().items() if v is not None]
        try:
            with client_settings(self._cfg):
                self._client.log_batch(self.run_id, metrics=metrics)
        except Exception as exc:  # noqa: BLE001 (any failure of the store: train on, registration logs it)
            log.warning("could not log epoch %d to MLflow live (%s); registration logs it", m.epoch + 1, exc)


def _execution_runs(client, experiment: str, execution: str, status: str = "RUNNING") -> list:
    return client.search_runs(
        [experiment],
        filter_string=f"tags.`{EXECUTION_TAG}` = '{execution}' and attributes.status = '{status}'",
    )


def save_rejected(cfg: MlflowConfig, execution: str, quarantine_dir: str, counts: dict) -> str:
    """Keep rejected data's quarantine (every row, its file, its row and its reason) in the
    execution's MLflow run, opened here if the execution has none yet; the run's id. The run
    stays RUNNING: the workflow's failure handler ends it FAILED, with the config beside it."""
    from mlflow import MlflowClient

    with client_settings(cfg):
        client = MlflowClient(tracking_uri())
        experiment = use_experiment(client, cfg.experiment)
        runs = _execution_runs(client, experiment, execution)
        run_id = (
            runs[0].info.run_id if runs else client.create_run(experiment, tags={EXECUTION_TAG: execution}).info.run_id
        )
        client.log_artifacts(run_id, quarantine_dir, "data/quarantine")
        for name, value in counts.items():
            client.log_metric(run_id, name, float(value))
        return run_id


def close_failed_runs(
    cfg: MlflowConfig, execution: str, error: str, params: dict | None = None, config: dict | None = None
) -> list[str]:
    """End the runs this execution left RUNNING as FAILED, with the error as a tag, and its
    params and `config.yaml` beside it, so a failed configuration can be compared with a good
    one; their ids. Given its `config`, an execution that failed before any run was opened (bad
    data, say) gets one.

    A task that fails would otherwise leave a live run RUNNING for ever. Best effort: the
    execution has failed already, and MLflow being away must not hide why. An error that comes
    of a deleted cached output (flyscale/flyte/outputs.py) is told with what to do, first.
    """
    if hint := outputs.gone(error):
        log.error(hint)
        error = f"{hint}\n{error}"
    try:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        with client_settings(cfg):
            client = MlflowClient(tracking_uri())
            experiment = use_experiment(client, cfg.experiment)
            runs = [r.info.run_id for r in _execution_runs(client, experiment, execution)]
            if config is not None and not runs and not _execution_runs(client, experiment, execution, "FINISHED"):
                runs = [client.create_run(experiment, tags={EXECUTION_TAG: execution}).info.run_id]
            for run_id in runs:
                logged = client.get_run(run_id).data.params
                fresh = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in (params or {}).items() if k not in logged]
                for at in range(0, len(fresh), 100):  # MLflow takes at most 100 params a batch
                    client.log_batch(run_id, params=fresh[at : at + 100])
                if config is not None:
                    client.log_dict(run_id, config, "config.yaml")
                client.set_tag(run_id, "flyscale.failure", error[:MAX_PARAM_CHARS])
                client.set_terminated(run_id, "FAILED")
                log.warning("MLflow run %s marked FAILED: %s", run_id, error.splitlines()[0] if error else "")
            return runs
    except Exception as exc:  # noqa: BLE001 (a failure handler must not fail: the run's error is what matters)
        log.warning("could not mark this execution's MLflow runs FAILED (%s)", exc)
        return []
