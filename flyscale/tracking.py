"""MLflow: one run per pipeline execution, registered model versions, the champion alias.

Only the register task calls this module, and it runs in one process, so "only rank 0 talks
to MLflow" holds by construction.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn

from flyscale.contracts import GateVerdict
from flyscale.evaluation import EvalMetrics, plot_confusion
from flyscale.preflight import PreflightReport
from flyscale.training import TrainHistory

log = logging.getLogger(__name__)

DEFAULT_STORE = "mlflow.db"


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


@dataclass
class RunRecord:
    """Everything the register task writes to MLflow."""

    params: dict[str, Any]
    history: TrainHistory
    fp32: EvalMetrics
    int8: EvalMetrics
    verdicts: list[GateVerdict]
    preflight: PreflightReport
    quarantined: pd.DataFrame  # rejected rows and why: kept with the run, never dropped silently
    validation: dict[str, int]
    tags: dict[str, str]


def champion_metrics(model_name: str, alias: str) -> dict[str, float] | None:
    """The test metrics of the version `alias` points at (keys without `test_`), or None.

    Read from the run that registered the champion, so a gate compares like with like.
    """
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri())
    try:
        version = client.get_model_version_by_alias(model_name, alias)
    except MlflowException:  # no such model, or no such alias yet: there is no champion
        return None
    metrics = client.get_run(version.run_id).data.metrics
    found = {k.removeprefix("test_"): v for k, v in metrics.items() if k.startswith("test_")}
    found["version"] = float(version.version)
    return found


def _pip_requirements() -> list[str]:
    # Naming them skips MLflow's slow requirement inference; the +cpu label is not on PyPI.
    return [f"torch=={torch.__version__.split('+')[0]}"]


def publish(
    record: RunRecord,
    fp32_model: nn.Module,
    int8_model: nn.Module,
    example: torch.Tensor,
    experiment: str,
    model_name: str,
    alias: str,
    run_name: str,
) -> Registration:
    """Log the run, register both models, and move `alias` only if every gate passed."""
    import mlflow
    from mlflow import MlflowClient

    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment)
    passed = all(v.passed for v in record.verdicts)
    with mlflow.start_run(run_name=run_name) as run:
        mlflow.set_tags({**record.tags, "flyscale.gates": "passed" if passed else "failed"})
        mlflow.log_params({k: str(v)[:500] for k, v in record.params.items()})
        for m in record.history.epochs:
            per_epoch = {
                "train_loss": m.train_loss,
                "train_accuracy": m.train_accuracy,
                "val_loss": m.val_loss,
                "val_accuracy": m.val_accuracy,
                "epoch_seconds": m.seconds,
                "samples_per_s": m.samples_per_s,
                "lr": m.lr,
                "data_wait_fraction": m.data_wait_fraction,
                "compute_fraction": m.compute_fraction,
                "comm_fraction": m.comm_fraction,
                "grad_comm_fraction": m.grad_comm_fraction,
                "peak_memory_mb": m.peak_memory_mb,
            }
            # Untracked values are NaN (train accuracy unless train.track_train_accuracy): leave them out.
            mlflow.log_metrics({k: v for k, v in per_epoch.items() if math.isfinite(v)}, step=m.epoch)
        drop = record.fp32.accuracy - record.int8.accuracy
        mlflow.log_metrics(
            {
                **record.fp32.scalars("test_"),
                **record.int8.scalars("int8_test_"),
                "int8_accuracy_drop": drop,
                **{f"validation_{k}": float(v) for k, v in record.validation.items()},
            }
        )
        if record.preflight.steps:
            mlflow.log_metric("preflight_max_rel_diff", record.preflight.max_rel_diff)
            mlflow.set_tag(
                "flyscale.preflight",
                f"passed: {record.preflight.steps} steps at world size 1 and {record.preflight.world_size}",
            )
        if record.history.diagnosis:
            mlflow.set_tag("flyscale.diagnosis", record.history.diagnosis)
        for v in record.verdicts:
            mlflow.set_tag(f"gate.{v.name}", f"{'passed' if v.passed else 'failed'}: {v.reason}")
        with tempfile.TemporaryDirectory() as tmp:
            if len(record.quarantined):
                record.quarantined.to_csv(f"{tmp}/quarantine.csv", index=False)
                mlflow.log_artifact(f"{tmp}/quarantine.csv", artifact_path="data")
            for label, metrics in (("fp32", record.fp32), ("int8", record.int8)):
                png = plot_confusion(metrics.confusion, f"{label} test confusion", f"{tmp}/confusion_{label}.png")
                mlflow.log_artifact(png, artifact_path="plots")
        fp32_info = mlflow.pytorch.log_model(
            fp32_model.eval(), name="model", input_example=example.numpy(), serialization_format="pt2",
            pip_requirements=_pip_requirements(), registered_model_name=model_name,
        )
        # torch.export cannot trace dynamically quantized Linear layers yet, hence pickle for int8.
        int8_info = mlflow.pytorch.log_model(
            int8_model.eval(), name="model_int8", serialization_format="pickle",
            pip_requirements=_pip_requirements(), registered_model_name=f"{model_name}-int8",
        )
    client = MlflowClient(uri)
    versions = (fp32_info.registered_model_version, int8_info.registered_model_version)
    for name, version in zip((model_name, f"{model_name}-int8"), versions):
        client.set_model_version_tag(name, str(version), "flyscale.gates", "passed" if passed else "failed")
        client.set_model_version_tag(name, str(version), "flyscale.run_id", run.info.run_id)
        if passed:
            client.set_registered_model_alias(name, alias, str(version))
    if not passed:
        reasons = "; ".join(v.reason for v in record.verdicts if not v.passed)
        log.warning("gate failed, %r alias not moved: %s", alias, reasons)
    return Registration(
        tracking_uri=uri,
        experiment_id=run.info.experiment_id,
        run_id=run.info.run_id,
        model_name=model_name,
        model_version=str(versions[0]),
        int8_model_name=f"{model_name}-int8",
        int8_model_version=str(versions[1]),
        champion=passed,
        alias=alias,
    )
