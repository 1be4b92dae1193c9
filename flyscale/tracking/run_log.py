"""What one execution's MLflow run holds: its params, metrics, tags and artifacts (`RunRecord`),
and the splits it trained and was tested on. Its two models are logged by model_log.py;
registering versions and moving the alias is `publish`'s.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flyscale.data.drift import summary as drift_summary
from flyscale.data.validation import ValidationReport
from flyscale.evaluate.gating import ChampionRef
from flyscale.evaluate.metrics import EvalMetrics
from flyscale.plugin.records import GateVerdict
from flyscale.tracking.store import MAX_PARAM_CHARS, _metric_name
from flyscale.train.preflight import PreflightReport
from flyscale.train.telemetry import TrainHistory


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
    kind: str = ""  # what the model takes and is for (flyscale/tracking/kind.py), as JSON
    # The reference validation held the data to, when `validation` states drift against another
    # (the champion judged against); None: `validation.reference`.
    validated_against: str | None = None
    reference_json: str = ""  # this data's pinned schema and profile: the reference for later batches
    validation_dir: str = ""  # the validation report (HTML and its plot), logged as it is
    config: dict[str, Any] = field(default_factory=dict)  # the effective config, whole: logged as config.yaml
    lineage: dict[str, str] = field(default_factory=dict)  # tags on every registered version
    test_sha256: str = ""  # the fingerprint of the test split the metrics were measured on
    metrics: dict[str, float] = field(default_factory=dict)  # further test metrics (latency, ece, per class)
    plots_dir: str = (
        ""  # the run's figures as PNGs (flyscale/render/plots.py draw_run), logged under plots/ as they are
    )
    tables: dict[str, list[dict]] = field(default_factory=dict)  # {artifact file: rows}, for mlflow.log_table
    artifact_dirs: dict[str, str] = field(default_factory=dict)  # {artifact path: local folder}, logged as they are
    started_at: float = 0.0  # when the execution started (the run's start time)
    datasets: list[LoggedDataset] = field(default_factory=list)  # what the run trained and was tested on
    onnx_path: str = ""  # the fp32 model as ONNX, logged as onnx/model.onnx
    onnx_parity: str = ""  # how it answered the test split against the PyTorch model
    # Why the int8 model is not registered as the twin (it does not pay: not smaller and faster);
    # "" when it is.
    int8_not_registered: str = ""


@dataclass
class LoggedDataset:
    """One split as MLflow's dataset tracking records it: the runs table's Dataset column shows
    `name (digest)` and the split, and the run's page its source and schema."""

    name: str  # the dataset (its plugin's name)
    digest: str  # the content fingerprint the run's lineage records, its first 12 digits and the split
    source: str  # where the data is: a path or s3:// URI, or "" for data a plugin makes (then `options`)
    context: str  # "training", "validation" or "testing"
    fields: dict[str, tuple[str, list[int]]]  # {field: (dtype, per-example shape)}
    options: str = ""  # the plugin's options (JSON), for data without a source URI


def log_datasets(datasets: list[LoggedDataset]) -> None:
    """Each split with `mlflow.log_input`: name, digest, source, schema, and the split as context."""
    import warnings

    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.types import ColSpec, Schema, TensorSpec

    for d in datasets:
        if d.source:
            with warnings.catch_warnings():  # MLflow registers two local sources and says so on each path
                warnings.simplefilter("ignore", UserWarning)
                source = resolve_dataset_source(d.source)
        else:
            source = CodeDatasetSource({"flyscale.dataset": d.name, "flyscale.options": d.options})
        specs = [
            ColSpec("string", name) if dtype == "string" else TensorSpec(np.dtype(dtype), (-1, *shape), name)
            for name, (dtype, shape) in d.fields.items()
        ]
        dataset = MetaDataset(source, name=d.name, digest=d.digest, schema=Schema(specs))  # type: ignore[abstract]  # profile is optional at run time
        _log_input(dataset, d.context)


def _log_input(dataset, context: str, attempts: int = 3) -> None:
    """`mlflow.log_input`, again where another run logged the same dataset at the same moment.

    The tracking server looks the dataset up, then inserts it if it was missing: two runs on the
    same data that both find it missing both insert it, and the later insert breaks the datasets
    table's unique key (a 400 naming the constraint, not a retryable 5xx). Logged again, the
    dataset is found and only linked to this run (the failed request changed nothing)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    for attempt in range(attempts):
        try:
            mlflow.log_input(dataset, context=context)
            return
        except MlflowException as exc:
            raced = any(s in str(exc).lower() for s in ("unique constraint", "duplicate key", "duplicate entry"))
            if not raced or attempt == attempts - 1:
                raise


def continued_run(client, history: TrainHistory) -> str:
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


def log_run(record: RunRecord, passed: bool) -> None:
    """Params, tags and artifacts of the active run (its metrics: `log_metrics`)."""
    import mlflow

    mlflow.set_tags(
        {
            **record.tags,
            "flyscale.gates": "passed" if passed else "failed",
            "flyscale.judged_against": record.judged_against.label(),
        }
    )
    # Whole values (the full config is config.yaml beside them); only a value past MLflow's own
    # limit is cut, and it says so.
    mlflow.log_params(
        {
            k: (
                str(v)
                if len(str(v)) <= MAX_PARAM_CHARS
                else str(v)[: MAX_PARAM_CHARS - 40] + " ... (cut: see config.yaml)"
            )
            for k, v in record.params.items()
        }
    )
    if record.config:
        mlflow.log_dict(record.config, "config.yaml")  # feed it back with `pyflyte run ... --cfg config.yaml`
    log_datasets(record.datasets)
    if record.validation.drift:  # every feature's PSI, worst first: the metrics hold only a summary
        import pandas as pd

        table = sorted(record.validation.drift.items(), key=lambda kv: -kv[1])
        mlflow.log_table(pd.DataFrame(table, columns=["feature", "psi"]), "data/drift.json")
    mlflow.set_tag("flyscale.data_reference", record.validation.reference or "none")
    for check, rows in record.validation.checks.items():
        mlflow.set_tag(f"validation.{_metric_name(check)}", str(rows))
    if record.history.workers:
        mlflow.set_tag("flyscale.workers", record.history.workers)
    if record.preflight.steps and record.preflight.checked:
        mlflow.set_tag(
            "flyscale.preflight",
            f"passed: {record.preflight.steps} steps at world size 1 and {record.preflight.world_size}",
        )
    if record.history.diagnosis:
        mlflow.set_tag("flyscale.diagnosis", record.history.diagnosis)
    if record.history.started_from:  # a warm start: the version (or run) and the weights it began from
        mlflow.set_tag("flyscale.init_from", record.history.started_from)
    if record.history.stopping:  # early stopping: which epoch's weights these are, and why training ended
        mlflow.set_tag("flyscale.early_stopping", record.history.stopping)
    for v in record.verdicts:
        mlflow.set_tag(f"gate.{v.name}", f"{'passed' if v.passed else 'failed'}: {v.reason}")
    for label, model in (("fp32", record.fp32), ("int8", record.int8)):
        if model.samples:  # a language model's continuations of fixed prompts, as a table and as text
            import pandas as pd

            made = [{"prompt": p, "continuation": c} for p, c in model.samples.items()]
            mlflow.log_table(pd.DataFrame(made), f"samples/{label}.json")
            mlflow.log_text("\n\n".join(f"{p}{c}" for p, c in model.samples.items()), f"samples/{label}.txt")
    if record.fp32.samples:
        prompt, continuation = next(iter(record.fp32.samples.items()))
        mlflow.set_tag("flyscale.sample", (prompt + continuation)[:250])
    if record.onnx_path:  # servable without flyscale or torch: onnxruntime and numpy
        mlflow.log_artifact(record.onnx_path, artifact_path="onnx")
    if record.onnx_parity:  # how the export answered, or why there is none
        mlflow.set_tag("flyscale.onnx_parity", record.onnx_parity[:5000])
    if record.plots_dir:
        # The files the quantize task drew (and showed in its Deck): logged, not drawn again.
        mlflow.log_artifacts(record.plots_dir, artifact_path="plots")
    for artifact_path, folder in record.artifact_dirs.items():
        mlflow.log_artifacts(folder, artifact_path=artifact_path)
    if record.tables:
        import pandas as pd

        for table_path, table_rows in record.tables.items():
            mlflow.log_table(pd.DataFrame(table_rows), table_path)
    with tempfile.TemporaryDirectory() as tmp:
        # Every rejected row, as it came in, with its file, its row in the file and the reason.
        mlflow.log_artifacts(record.quarantine_dir, artifact_path="data/quarantine")
        Path(f"{tmp}/reference.json").write_text(record.reference_json)
        mlflow.log_artifact(f"{tmp}/reference.json", artifact_path="data")
        if record.validation_dir:
            mlflow.log_artifacts(record.validation_dir, artifact_path="data/validation")


def log_metrics(client, run_id: str, record: RunRecord, epochs_logged: bool) -> list:
    """Run `run_id`'s metrics: each epoch's (unless logged live) and what the run measured of its
    models and data; returns those at step 0 (MLflow Metrics, for `model_log.link_metrics`).
    Logged as the run's own, by the client: once the run holds models, MLflow's fluent
    log_metrics logs a step-0 metric only to them."""
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics: list[Metric] = []
    for m in record.history.epochs if not epochs_logged else []:
        # Everything measured is logged, NaN included (a divergence shows as one); None is "not measured".
        metrics += [Metric(k, float(v), now, m.epoch) for k, v in m.per_epoch().items() if v is not None]
    drift_threshold = float(record.config.get("data", {}).get("max_drift_psi") or 0.0)
    final = {
        **record.fp32.scalars("test_"),
        **record.int8.scalars("int8_test_"),
        **{_metric_name(k): v for k, v in record.metrics.items()},
        **({"int8_accuracy_drop": record.fp32.accuracy - record.int8.accuracy} if record.fp32.classifier else {}),
        "validation_total_rows": record.validation.total_rows,
        "validation_valid_rows": record.validation.valid_rows,
        "validation_quarantined_rows": record.validation.quarantined_rows,
        **{_metric_name(k): v for k, v in drift_summary(record.validation.drift, drift_threshold).items()},
    }
    if record.preflight.steps and record.preflight.checked:
        final["preflight_max_rel_diff"] = record.preflight.max_rel_diff
    if record.history.stopping:
        final["kept_epoch"] = record.history.kept_epoch
    metrics += [Metric(k, float(v), now, 0) for k, v in final.items()]
    client.log_batch(run_id, metrics=metrics)
    return [m for m in metrics if m.step == 0]
