"""MLflow: one run per pipeline execution, registered model versions, the champion alias.

Only the gate and register tasks call this module, each in one process, so "only rank 0 talks
to MLflow" holds by construction. Registration leaves the registry as it was or complete: the
run and both models are logged first, the versions are registered next, and the alias moves
last, by compare-and-set (flyscale/champion.py). If MLflow fails on the way, what this run
registered is deleted again and the run fails with a retryable error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from flyscale import champion
from flyscale.champion import ChampionRef, Promotion
from flyscale.config import MlflowConfig
from flyscale.contracts import GateVerdict
from flyscale.evaluation import EvalMetrics, plot_confusion
from flyscale.preflight import PreflightReport
from flyscale.training import TrainHistory
from flyscale.validation import Reference, ValidationReport, load_reference

log = logging.getLogger(__name__)

DEFAULT_STORE = "mlflow.db"
DATA_TAG = "flyscale.data_sha256"  # on each version: the content fingerprint of the data it was trained on
REFERENCE_TAG = "flyscale.reference_version"  # on each version: the version whose reference its data met


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
    model_version: str
    int8_model_name: str
    int8_model_version: str
    champion: bool  # whether the alias was moved to these versions
    alias: str
    promotion: str = ""  # why it moved, or why not
    judged_against: str = ""  # the champion the verdict was judged against ("" = none)


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
        run_id = version.tags.get("flyscale.run_id") or version.run_id
        if "data/reference.json" not in {a.path for a in client.list_artifacts(run_id, "data")}:
            return Reference(source=f"v{version.version} (which recorded no reference)")
        with tempfile.TemporaryDirectory() as tmp:
            text = Path(client.download_artifacts(run_id, "data/reference.json", tmp)).read_text()
        return load_reference(text, f"v{version.version}")


def _metric_name(text: str) -> str:
    """MLflow names allow letters, digits and _-./ and spaces only."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in text)


def _pip_requirements() -> list[str]:
    # Naming them skips MLflow's slow requirement inference; the +cpu label is not on PyPI.
    return [f"torch=={torch.__version__.split('+')[0]}"]


def _log_run(record: RunRecord, passed: bool) -> None:
    """Params, per-epoch and test metrics, tags and artifacts of the active run."""
    import mlflow

    mlflow.set_tags({**record.tags, "flyscale.gates": "passed" if passed else "failed",
                     "flyscale.judged_against": record.judged_against.label()})
    mlflow.log_params({k: str(v)[:500] for k, v in record.params.items()})
    for m in record.history.epochs:
        # Everything measured is logged, NaN included (a divergence shows as one); None is "not measured".
        mlflow.log_metrics({k: float(v) for k, v in m.per_epoch().items() if v is not None}, step=m.epoch)
    mlflow.log_metrics({
        **record.fp32.scalars("test_"),
        **record.int8.scalars("int8_test_"),
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
    with tempfile.TemporaryDirectory() as tmp:
        # Every rejected row, as it came in, with its file, its row in the file and the reason.
        mlflow.log_artifacts(record.quarantine_dir, artifact_path="data/quarantine")
        Path(f"{tmp}/reference.json").write_text(record.reference_json)
        mlflow.log_artifact(f"{tmp}/reference.json", artifact_path="data")
        if record.validation_dir:
            mlflow.log_artifacts(record.validation_dir, artifact_path="data/validation")
        for label, metrics in (("fp32", record.fp32), ("int8", record.int8)):
            png = plot_confusion(metrics.confusion, f"{label} test confusion", f"{tmp}/confusion_{label}.png")
            mlflow.log_artifact(png, artifact_path="plots")


def publish(
    record: RunRecord, fp32_model: nn.Module, int8_model: nn.Module, example: torch.Tensor, cfg: MlflowConfig,
    run_name: str,
) -> Registration:
    """Log the run, register both models, and move the alias (compare-and-set) if every gate passed."""
    with client_settings(cfg), champion.mlflow_errors(f"registering {cfg.model_name!r}"):
        return _publish(record, fp32_model, int8_model, example, cfg, run_name)


def _publish(record, fp32_model, int8_model, example, cfg: MlflowConfig, run_name: str) -> Registration:
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(cfg.experiment)
    client = MlflowClient(uri)
    passed = all(v.passed for v in record.verdicts)
    names = (cfg.model_name, f"{cfg.model_name}-int8")
    registered: list[tuple[str, str]] = []
    with mlflow.start_run(run_name=run_name) as run:  # an exception ends the run as FAILED
        try:
            _log_run(record, passed)
            # Log both models before registering either: a failure here leaves no version behind.
            infos = [
                mlflow.pytorch.log_model(
                    fp32_model.eval(), name="model", input_example=example.numpy(), serialization_format="pt2",
                    pip_requirements=_pip_requirements(),
                ),
                # torch.export cannot trace dynamically quantized Linear layers yet, hence pickle for int8.
                mlflow.pytorch.log_model(
                    int8_model.eval(), name="model_int8", serialization_format="pickle",
                    pip_requirements=_pip_requirements(),
                ),
            ]
            tags = {
                "flyscale.gates": "passed" if passed else "failed", "flyscale.run_id": run.info.run_id,
                champion.WEIGHTS_TAG: record.weights_sha256, champion.JUDGED_TAG: record.judged_against.version,
                DATA_TAG: record.data_sha256, REFERENCE_TAG: _version_of(record.validation.reference),
            }
            for name, info in zip(names, infos):
                version = mlflow.register_model(info.model_uri, name, tags=tags)
                registered.append((name, str(version.version)))
            if passed:
                promotion = champion.promote(
                    client, registered, cfg.alias, record.judged_against, record.weights_sha256,
                    cfg.lock_timeout_s, cfg.lock_stale_s,
                )
            else:
                failed = "; ".join(v.reason for v in record.verdicts if not v.passed)
                promotion = Promotion(False, f"not promoted: a gate failed ({failed})")
        except BaseException:
            # Before the alias moved (promote puts it back if it fails half-way): the registry
            # stays as it was, with no half-registered run.
            for name, version in registered:
                with contextlib.suppress(MlflowException):
                    client.delete_model_version(name, version)
            raise
        try:  # the registry is complete and consistent now; the reason is a note on it
            mlflow.set_tag("flyscale.promotion", promotion.reason)
            for name, version in registered:
                client.set_model_version_tag(name, version, "flyscale.promotion", promotion.reason)
        except MlflowException as exc:
            log.warning("could not record the promotion reason on the run: %s", exc)
    if not promotion.moved:
        log.warning("%r alias not moved: %s", cfg.alias, promotion.reason)
    return Registration(
        tracking_uri=uri, experiment_id=run.info.experiment_id, run_id=run.info.run_id,
        model_name=names[0], model_version=registered[0][1], int8_model_name=names[1],
        int8_model_version=registered[1][1], champion=promotion.moved, alias=cfg.alias,
        promotion=promotion.reason, judged_against=record.judged_against.version,
    )
