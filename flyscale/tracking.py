"""MLflow: one run per pipeline execution, registered model versions, the champion alias.

Only the gate and register tasks call this module, each in one process, so "only rank 0 talks
to MLflow" holds by construction. Registration leaves the registry as it was or complete: the
run and both models are logged first, the versions are registered next, and the alias moves
last, by compare-and-set (flyscale/champion.py). If MLflow fails on the way, what this run
registered is deleted again and the run fails with a retryable error.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from flyscale import champion
from flyscale.champion import ChampionRef, Promotion
from flyscale.config import MlflowConfig
from flyscale.contracts import GateVerdict
from flyscale.evaluation import EvalMetrics
from flyscale.preflight import PreflightReport
from flyscale.training import TrainHistory
from flyscale.validation import Reference, ValidationReport, load_reference

log = logging.getLogger(__name__)

DEFAULT_STORE = "mlflow.db"
# What MLflow 3 records an experiment's kind in. (MLflow 3.17's UI still opens every experiment
# on the GenAI overview unless the URL says ?workflowType=machine_learning: the summary prints that URL.)
KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"
DATA_TAG = "flyscale.data_sha256"  # on each version: the content fingerprint of the data it was trained on
REFERENCE_TAG = "flyscale.reference_version"  # on each version: the version whose reference its data met
# On each version: where its own data's reference.json is. Read straight from there, a cached run
# does not load the whole run (every metric, param and tag: 0.3 s from SQLite) to find one file.
REFERENCE_URI_TAG = "flyscale.reference_uri"
EXECUTION_TAG = "flyscale.execution"  # on each run: the pipeline execution (provenance.execution_key)


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI if set, else a SQLite store in the working directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / DEFAULT_STORE}"


@dataclass
class Registration:
    """Where a run and its models went; printed in the summary."""

    tracking_uri: str
    experiment_id: str
    run_id: str
    model_name: str
    model_version: str  # "" when nothing was registered (a gate failed)
    int8_model_name: str
    int8_model_version: str
    champion: bool  # whether the alias was moved to these versions
    alias: str
    promotion: str = ""  # why it moved, or why not
    judged_against: str = ""  # the champion the verdict was judged against ("" = none)
    run_name: str = ""
    reused: bool = False  # these weights were registered before: the existing versions were kept


@dataclass
class RunRecord:
    """Everything the register task writes to MLflow."""

    params: dict[str, Any]
    history: TrainHistory
    fp32: EvalMetrics
    int8: EvalMetrics
    verdicts: list[GateVerdict]
    preflight: PreflightReport
    quarantine_dir: str  # rejected rows and why, as Parquet shards: kept with the run, never dropped silently
    validation: ValidationReport
    tags: dict[str, str]
    judged_against: ChampionRef = field(default_factory=lambda: ChampionRef("", ""))
    weights_sha256: str = ""
    data_sha256: str = ""  # the content fingerprint of the data trained on
    reference_json: str = ""  # this data's pinned schema and profile: the reference for later batches
    validation_dir: str = ""  # the validation report (HTML and its plot), logged as it is
    config: dict[str, Any] = field(default_factory=dict)  # the effective config, whole: logged as config.yaml
    lineage: dict[str, str] = field(default_factory=dict)  # tags on every registered version
    test_sha256: str = ""  # the fingerprint of the test split the metrics were measured on
    metrics: dict[str, float] = field(default_factory=dict)  # further test metrics (latency, ece, per class)
    plots_dir: str = ""  # the run's figures as PNGs (flyscale/plots.py draw_run), logged under plots/ as they are
    tables: dict[str, list[dict]] = field(default_factory=dict)  # {artifact file: rows}, for mlflow.log_table
    started_at: float = 0.0  # when the execution started (the run's start time)


@contextlib.contextmanager
def client_settings(cfg: MlflowConfig) -> Iterator[None]:
    """MLflow's HTTP retries bounded as configured (its defaults retry for about four minutes).

    MLflow reads these variables on every request; values the user exported win.
    """
    wanted = {
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(cfg.retries),
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": str(cfg.retry_backoff_s),
        "MLFLOW_HTTP_REQUEST_TIMEOUT": str(cfg.request_timeout_s),
    }
    added = {k: v for k, v in wanted.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def read_baseline(cfg: MlflowConfig, candidate_sha256: str) -> ChampionRef:
    """The champion a candidate is judged against, read live from the store (fails closed)."""
    from mlflow import MlflowClient

    with client_settings(cfg), champion.mlflow_errors(f"reading the {cfg.alias!r} of {cfg.model_name!r}"):
        return champion.baseline(MlflowClient(tracking_uri()), cfg.model_name, cfg.alias, candidate_sha256)


def _version_of(source: str) -> str:
    """'v3' -> '3' (a reference from a champion); anything else -> ''."""
    head = source.split(" ")[0]
    return head[1:] if head.startswith("v") and head[1:].isdigit() else ""


def read_reference(cfg: MlflowConfig, reference_file: str, data_sha256: str) -> Reference:
    """What new data is validated against: `reference_file` if given, else the reference recorded
    with the champion (fails closed like the champion read). A champion trained on these very
    bytes is held to what it was itself validated against, so a rerun replays its validation."""
    if reference_file:
        path = Path(reference_file).expanduser()
        if not path.is_file():
            raise ValueError(f"data.reference {reference_file!r} does not exist")
        return load_reference(path.read_text(), str(path))
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    with client_settings(cfg), champion.mlflow_errors(f"reading the data reference of {cfg.model_name!r}"):
        client = MlflowClient(tracking_uri())
        version = champion.current_version(client, cfg.model_name, cfg.alias)
        if version is not None and version.tags.get(DATA_TAG) == data_sha256:
            against = version.tags.get(REFERENCE_TAG, "")
            try:
                version = client.get_model_version(cfg.model_name, against) if against else None
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                version = None
        if version is None:
            return Reference()
        with tempfile.TemporaryDirectory() as tmp:
            if uri := version.tags.get(REFERENCE_URI_TAG):
                import mlflow.artifacts

                text = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=tmp,
                                                                tracking_uri=tracking_uri())).read_text()
                return load_reference(text, f"v{version.version}")
            # A version registered before the tag: look in its run.
            run_id = version.tags.get("flyscale.run_id") or version.run_id
            if "data/reference.json" not in {a.path for a in client.list_artifacts(run_id, "data")}:
                return Reference(source=f"v{version.version} (which recorded no reference)")
            text = Path(client.download_artifacts(run_id, "data/reference.json", tmp)).read_text()
        return load_reference(text, f"v{version.version}")


def _metric_name(text: str) -> str:
    """MLflow names allow letters, digits and _-./ and spaces only."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in text)


def use_experiment(client, name: str) -> str:
    """The experiment's id, created as a model-training experiment (MLflow's kind tag); an
    existing one without a kind gets it."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name, tags={KIND_TAG: TRAINING_KIND})
        except MlflowException as exc:  # created by a concurrent run meanwhile
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            experiment = client.get_experiment_by_name(name)
    if KIND_TAG not in experiment.tags:
        client.set_experiment_tag(experiment.experiment_id, KIND_TAG, TRAINING_KIND)
    return experiment.experiment_id


def run_name(model: str, strategy: str, world_size: int, data_sha256: str, started_at: float) -> str:
    """`mlp-ddp2-data1c6f78c9-20261201-103512`: the model, the strategy and workers, the data
    version and when the execution started, so runs are told apart in the UI's lists."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(started_at))
    return f"{model}-{strategy}{world_size}-data{data_sha256[:8]}-{stamp}"


class LiveRun:
    """The execution's MLflow run, opened by training's rank 0, which logs every epoch to it as
    the epoch ends, so the curves grow in the UI while training runs. Best effort: MLflow being
    away costs the live curves (registration logs them afterwards), never the training."""

    def __init__(self, cfg: MlflowConfig, name: str, started_at: float, execution: str):
        self.run_id, self._client = "", None
        try:
            from mlflow import MlflowClient

            with client_settings(cfg):
                client = MlflowClient(tracking_uri())
                experiment = use_experiment(client, cfg.experiment)
                # A restarted worker group or a retried task carries on with the run it had opened.
                earlier = client.search_runs(
                    [experiment], max_results=1,
                    filter_string=f"tags.`{EXECUTION_TAG}` = '{execution}' and tags.`flyscale.live` = 'training' "
                                  f"and attributes.status = 'RUNNING' and attributes.start_time = {int(started_at * 1000)}",
                )
                # The execution tag lets the workflow's failure handler find and close this run.
                run = earlier[0] if earlier else client.create_run(
                    experiment, start_time=int(started_at * 1000), run_name=name,
                    tags={"flyscale.live": "training", EXECUTION_TAG: execution})
            self.run_id, self._client, self._cfg = run.info.run_id, client, cfg
            log.info("training curves live in MLflow: run %s (%s)%s", self.run_id, name, " (continued)" if earlier else "")
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
        except Exception as exc:  # noqa: BLE001
            log.warning("could not log epoch %d to MLflow live (%s); registration logs it", m.epoch + 1, exc)


def close_failed_runs(cfg: MlflowConfig, execution: str, error: str) -> list[str]:
    """Mark the runs this execution left RUNNING as FAILED, with the error as a tag; their ids.

    A task after training that fails (evaluation, quantization, the gate) would otherwise leave
    the live run RUNNING for ever. Best effort: the execution has failed already, and MLflow
    being away must not hide why.
    """
    try:
        from mlflow import MlflowClient

        with client_settings(cfg):
            client = MlflowClient(tracking_uri())
            experiment = client.get_experiment_by_name(cfg.experiment)
            if experiment is None:
                return []
            runs = client.search_runs(
                [experiment.experiment_id],
                filter_string=f"tags.`{EXECUTION_TAG}` = '{execution}' and attributes.status = 'RUNNING'",
            )
            for run in runs:
                client.set_tag(run.info.run_id, "flyscale.failure", error[:MAX_PARAM_CHARS])
                client.set_terminated(run.info.run_id, "FAILED")
                log.warning("MLflow run %s marked FAILED: %s", run.info.run_id, error.splitlines()[0] if error else "")
            return [r.info.run_id for r in runs]
    except Exception as exc:  # noqa: BLE001
        log.warning("could not mark this execution's MLflow runs FAILED (%s)", exc)
        return []


def _continued_run(client, history: TrainHistory) -> str:
    """The run training logged live in this execution (still RUNNING), or "" for a new one: a
    cached training step's run belongs to the execution that trained it."""
    if not history.mlflow_run_id:
        return ""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(history.mlflow_run_id)
    except MlflowException:
        return ""
    return history.mlflow_run_id if run.info.status == "RUNNING" else ""


def _pip_requirements() -> list[str]:
    # Naming them skips MLflow's slow requirement inference; the +cpu label is not on PyPI.
    return [f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={_version('mlflow')}"]


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


MAX_PARAM_CHARS = 6000  # MLflow 3's limit on a param value


def _log_run(record: RunRecord, passed: bool, epochs_logged: bool) -> None:
    """Params, per-epoch (unless logged live) and test metrics, tags and artifacts of the active run."""
    import mlflow

    mlflow.set_tags({**record.tags, "flyscale.gates": "passed" if passed else "failed",
                     "flyscale.judged_against": record.judged_against.label()})
    # Whole values (the full config is config.yaml beside them); only a value past MLflow's own
    # limit is cut, and it says so.
    mlflow.log_params({k: (str(v) if len(str(v)) <= MAX_PARAM_CHARS else str(v)[: MAX_PARAM_CHARS - 40]
                          + " ... (cut: see config.yaml)") for k, v in record.params.items()})
    if record.config:
        mlflow.log_dict(record.config, "config.yaml")  # feed it back with `pyflyte run ... --cfg config.yaml`
    for m in record.history.epochs if not epochs_logged else []:
        # Everything measured is logged, NaN included (a divergence shows as one); None is "not measured".
        mlflow.log_metrics({k: float(v) for k, v in m.per_epoch().items() if v is not None}, step=m.epoch)
    mlflow.log_metrics({
        **record.fp32.scalars("test_"),
        **record.int8.scalars("int8_test_"),
        **{_metric_name(k): v for k, v in record.metrics.items()},
        "int8_accuracy_drop": record.fp32.accuracy - record.int8.accuracy,
        "validation_total_rows": record.validation.total_rows,
        "validation_valid_rows": record.validation.valid_rows,
        "validation_quarantined_rows": record.validation.quarantined_rows,
        **{f"drift_psi_{_metric_name(k)}": v for k, v in record.validation.drift.items()},
    })
    mlflow.set_tag("flyscale.data_reference", record.validation.reference or "none")
    for check, rows in record.validation.checks.items():
        mlflow.set_tag(f"validation.{_metric_name(check)}", str(rows))
    if record.preflight.steps:
        mlflow.log_metric("preflight_max_rel_diff", record.preflight.max_rel_diff)
        mlflow.set_tag(
            "flyscale.preflight", f"passed: {record.preflight.steps} steps at world size 1 and {record.preflight.world_size}"
        )
    if record.history.diagnosis:
        mlflow.set_tag("flyscale.diagnosis", record.history.diagnosis)
    for v in record.verdicts:
        mlflow.set_tag(f"gate.{v.name}", f"{'passed' if v.passed else 'failed'}: {v.reason}")
    if record.plots_dir:
        # The files the quantize task drew (and showed in its Deck): logged, not drawn again.
        mlflow.log_artifacts(record.plots_dir, artifact_path="plots")
    if record.tables:
        import pandas as pd

        for path, rows in record.tables.items():
            mlflow.log_table(pd.DataFrame(rows), path)
    with tempfile.TemporaryDirectory() as tmp:
        # Every rejected row, as it came in, with its file, its row in the file and the reason.
        mlflow.log_artifacts(record.quarantine_dir, artifact_path="data/quarantine")
        Path(f"{tmp}/reference.json").write_text(record.reference_json)
        mlflow.log_artifact(f"{tmp}/reference.json", artifact_path="data")
        if record.validation_dir:
            mlflow.log_artifacts(record.validation_dir, artifact_path="data/validation")


@dataclass
class ModelFiles:
    """One model as flyscale logs it: its weights (a state_dict file) and what rebuilds it."""

    weights_path: str
    spec_json: str  # flyscale/model_spec.py


def _log_model(files: ModelFiles, name: str, example: np.ndarray, tmp: str):
    """A pickle-free MLflow model: flyscale/mlflow_model.py as its code, weights and spec as
    artifacts, with a signature and an input example. Returns the ModelInfo (a LoggedModel)."""
    import mlflow
    from mlflow.models import infer_signature

    from flyscale.model_spec import build

    spec = Path(tmp) / f"{name}_spec.json"
    spec.write_text(files.spec_json)
    with warnings.catch_warnings():  # MLflow asks for type hints on predict(); the signature says it all
        warnings.filterwarnings("ignore", message=".*type hints to the `predict` method", category=UserWarning)
        from flyscale import mlflow_model

        probabilities = mlflow_model.FlyscaleModel()
        probabilities.model = build(json.loads(files.spec_json), files.weights_path)
        signature = infer_signature(example, probabilities.predict(None, example))
        return mlflow.pyfunc.log_model(
            name=name, python_model=mlflow_model.__file__, artifacts={"weights": files.weights_path, "spec": str(spec)},
            signature=signature, input_example=example, pip_requirements=_pip_requirements(),
        )


REGISTRATION_TAG = "flyscale.registration_key"  # these weights trained on this data: one version, however often registered


def _registration_key(record: RunRecord) -> str:
    """The identity of a training run's result: its weights and the data they were trained and
    tested on (the same weights from other data are another run, with another lineage)."""
    return f"{record.weights_sha256}:{record.data_sha256}"


def _registered(client, name: str, key: str):
    """The version of `name` already registered for this key, or None (registration is idempotent)."""
    found = client.search_model_versions(f"name = '{name}' and tags.`{REGISTRATION_TAG}` = '{key}'")
    return min(found, key=lambda v: int(v.version)) if found else None


def publish(
    record: RunRecord, fp32: ModelFiles, int8: ModelFiles, example: np.ndarray, cfg: MlflowConfig, name: str,
    register: bool,
) -> Registration:
    """Log the run and both models; when `register` (every gate passed), register them (once per
    weights) and move the alias by compare-and-set, or set the challenger alias for a person to
    promote. A failed candidate is logged, with its models, and registered as no version."""
    with client_settings(cfg), champion.mlflow_errors(f"registering {cfg.model_name!r}"):
        return _publish(record, fp32, int8, example, cfg, name, register)


def _publish(record, fp32: ModelFiles, int8: ModelFiles, example, cfg: MlflowConfig, name: str,
             register: bool) -> Registration:
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    experiment_id = use_experiment(client, cfg.experiment)
    mlflow.set_experiment(experiment_id=experiment_id)
    passed = all(v.passed for v in record.verdicts)
    names = (cfg.model_name, f"{cfg.model_name}-int8")
    registered: list[tuple[str, str]] = []
    created: list[tuple[str, str]] = []  # only what this run added is undone on failure
    reused = False
    live = _continued_run(client, record.history)
    # One run per execution, spanning it: the one training opened, or one that starts when the execution did.
    run_args = {"run_id": live} if live else {
        "run_id": client.create_run(experiment_id, start_time=int(record.started_at * 1000), run_name=name).info.run_id}
    with mlflow.start_run(**run_args) as run, tempfile.TemporaryDirectory() as tmp:  # an exception ends it FAILED
        try:
            _log_run(record, passed, epochs_logged=bool(live))
            # Log both models before registering either: a failure here leaves no version behind.
            infos = [_log_model(fp32, "model", example, tmp), _log_model(int8, "model_int8", example, tmp)]
            if not register:
                failed = "; ".join(f"{v.name}: {v.reason}" for v in record.verdicts if not v.passed)
                promotion = Promotion(False, f"not registered: a gate failed ({failed})")
            else:
                tags = {
                    "flyscale.gates": "passed", "flyscale.run_id": run.info.run_id,
                    champion.WEIGHTS_TAG: record.weights_sha256, champion.JUDGED_TAG: record.judged_against.version,
                    champion.TEST_DATA_TAG: record.test_sha256,
                    DATA_TAG: record.data_sha256, REFERENCE_TAG: _version_of(record.validation.reference),
                    REFERENCE_URI_TAG: f"{run.info.artifact_uri}/data/reference.json",
                    **record.lineage, REGISTRATION_TAG: _registration_key(record),
                    **{f"flyscale.gate.{v.name}": f"passed: {v.reason}" for v in record.verdicts},
                }
                for model_name, info in zip(names, infos):
                    earlier = _registered(client, model_name, _registration_key(record))
                    if earlier is not None:
                        registered.append((model_name, str(earlier.version)))
                        reused = True
                        continue
                    version = mlflow.register_model(info.model_uri, model_name, tags=tags)
                    registered.append((model_name, str(version.version)))
                    created.append((model_name, str(version.version)))
                if cfg.promotion == "manual":
                    for model_name, version in registered:
                        client.set_registered_model_alias(model_name, cfg.challenger_alias, version)
                    promotion = Promotion(False, f"'{cfg.challenger_alias}' -> v{registered[0][1]} "
                                          f"(mlflow.promotion is manual: promote it with `flyscale promote`)")
                else:
                    promotion = champion.promote(
                        client, registered, cfg.alias, record.judged_against, record.weights_sha256,
                        cfg.lock_timeout_s, cfg.lock_stale_s,
                    )
        except BaseException:
            # Before the alias moved (promote puts it back if it fails half-way): the registry
            # stays as it was, with no half-registered run.
            for model_name, version in created:
                with contextlib.suppress(MlflowException):
                    client.delete_model_version(model_name, version)
            raise
        try:  # the registry is complete and consistent now; the reason is a note on it
            mlflow.set_tag("flyscale.promotion", promotion.reason)
            for model_name, version in created:
                client.set_model_version_tag(model_name, version, "flyscale.promotion", promotion.reason)
        except MlflowException as exc:
            log.warning("could not record the promotion reason on the run: %s", exc)
    if not promotion.moved:
        log.warning("%r alias not moved: %s", cfg.alias, promotion.reason)
    versions = dict(registered)
    return Registration(
        tracking_uri=uri, experiment_id=run.info.experiment_id, run_id=run.info.run_id,
        model_name=names[0], model_version=versions.get(names[0], ""), int8_model_name=names[1],
        int8_model_version=versions.get(names[1], ""), champion=promotion.moved, alias=cfg.alias,
        promotion=promotion.reason, judged_against=record.judged_against.version, run_name=name, reused=reused,
    )
