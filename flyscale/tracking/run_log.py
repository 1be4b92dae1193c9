"""What one execution's MLflow run holds: its params, metrics, tags and artifacts (`RunRecord`),
and its two models, logged pickle-free (`ModelFiles`). Registering versions and moving the
alias is `publish`'s.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flyscale.data.drift import summary as drift_summary
from flyscale.data.validation import ValidationReport
from flyscale.evaluate.gating import ChampionRef
from flyscale.evaluate.metrics import EvalMetrics
from flyscale.plugin.contracts import GateVerdict
from flyscale.tracking.store import (
    MAX_PARAM_CHARS,
    _metric_name,
    quiet_artifacts,
)
from flyscale.train.preflight import PreflightReport
from flyscale.train.telemetry import TrainHistory

log = logging.getLogger(__name__)


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

    import mlflow
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
        mlflow.log_input(dataset, context=d.context)


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


def _pip_requirements(tokenizer: bool = False) -> list[str]:
    # Naming them skips MLflow's slow requirement inference; the +cpu label is not on PyPI.
    named = [f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={_version('mlflow')}"]
    return [*named, f"tokenizers=={_version('tokenizers')}"] if tokenizer else named


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def log_run(record: RunRecord, passed: bool, epochs_logged: bool) -> None:
    """Params, per-epoch (unless logged live) and test metrics, tags and artifacts of the active run."""
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
    for m in record.history.epochs if not epochs_logged else []:
        # Everything measured is logged, NaN included (a divergence shows as one); None is "not measured".
        mlflow.log_metrics({k: float(v) for k, v in m.per_epoch().items() if v is not None}, step=m.epoch)
    drift_threshold = float(record.config.get("data", {}).get("max_drift_psi") or 0.0)
    mlflow.log_metrics(
        {
            **record.fp32.scalars("test_"),
            **record.int8.scalars("int8_test_"),
            **{_metric_name(k): v for k, v in record.metrics.items()},
            **({"int8_accuracy_drop": record.fp32.accuracy - record.int8.accuracy} if record.fp32.classifier else {}),
            "validation_total_rows": record.validation.total_rows,
            "validation_valid_rows": record.validation.valid_rows,
            "validation_quarantined_rows": record.validation.quarantined_rows,
            **{_metric_name(k): v for k, v in drift_summary(record.validation.drift, drift_threshold).items()},
        }
    )
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
        mlflow.log_metric("preflight_max_rel_diff", record.preflight.max_rel_diff)
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
        mlflow.log_metric("kept_epoch", record.history.kept_epoch)
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


@dataclass
class ModelFiles:
    """One model as flyscale logs it: its weights (a state_dict file), what rebuilds it, and a
    language model's tokenizer (its JSON; "" for none)."""

    weights_path: str
    spec_json: str  # flyscale/tracking/model_spec.py
    tokenizer_json: str = ""
    # The model as ONNX: registered to be served by ONNX Runtime alone (flyscale/export/onnx_pyfunc/)
    # where its objective says how; "" (or an objective that cannot say) keeps the PyTorch model.
    onnx_path: str = ""
    # What one request may ask of the ONNX-served model (ServingConfig.limits()), written into its
    # serving JSON; empty: the served model's defaults.
    limits: dict = field(default_factory=dict)


def log_model(files: ModelFiles, name: str, tmp: str):
    """A pickle-free MLflow model logged to the active run as `name` (see `model_args`). Returns
    the ModelInfo (a LoggedModel)."""
    import mlflow

    # MLflow checks the input example by loading the model: a download, with a bar per file.
    with quiet_artifacts():
        return mlflow.pyfunc.log_model(name=name, **model_args(files, name, tmp))


def save_model(files: ModelFiles, path: str, tmp: str) -> None:
    """The model as `log_model` logs it, saved to the folder `path` instead of a run."""
    import mlflow

    with quiet_artifacts():
        mlflow.pyfunc.save_model(path, **model_args(files, "model", tmp))


def model_args(files: ModelFiles, name: str, tmp: str) -> dict:
    """What mlflow.pyfunc's log_model or save_model takes for a pickle-free flyscale model (files
    written under `tmp`), with the signature, input example and inference params its objective
    gives (flyscale/tracking/model_io.py).

    With an ONNX file, and an objective that says how it serves: flyscale/export/onnx_pyfunc/ as the
    code and ONNX Runtime, numpy (and a BPE's tokenizers) as its only requirements; the weights
    and spec ride along for fine-tuning. Otherwise flyscale/tracking/model_code.py, which needs
    torch, flyscale and the model's plugin."""
    from mlflow.models import infer_signature

    from flyscale.data.fields import PIXEL_DIVISOR, model_input_shape
    from flyscale.export import onnx as onnx_export
    from flyscale.export import onnx_pyfunc
    from flyscale.export.onnx_pyfunc.predictor import LIMITS, Served
    from flyscale.tracking import model_code as mlflow_model
    from flyscale.tracking import model_io
    from flyscale.tracking.model_spec import build, objective_of

    spec_file = Path(tmp) / f"{name}_spec.json"
    spec_file.write_text(files.spec_json)
    artifacts = {"weights": files.weights_path, "spec": str(spec_file)}
    if files.tokenizer_json:
        tokenizer_file = Path(tmp) / f"{name}_tokenizer.json"
        tokenizer_file.write_text(files.tokenizer_json)
        artifacts["tokenizer"] = str(tokenizer_file)
    spec = json.loads(files.spec_json)
    objective, context = objective_of(spec, files.tokenizer_json)
    example, params = model_io.example(objective, context)
    exported = files.onnx_path
    how = onnx_export.serving(objective, context) if exported else None
    metadata = None
    inputs = None
    if how is not None:
        field = context.info.input()
        tokens = field is not None and not field.dtype.startswith("float") and field.dtype != "uint8"
        how["input"] = {"dtype": "int64" if tokens else "float32", "shape": model_input_shape(context.info)}
        if field is not None and field.dtype == "uint8":  # pixels: the served model scales them as training did
            how["input"]["pixels"] = {"divisor": PIXEL_DIVISOR}
        how["limits"] = {**LIMITS, **files.limits}  # enforced wherever the model is served
        serving_file = Path(tmp) / f"{name}_serving.json"
        serving_file.write_text(json.dumps(how, sort_keys=True))
        artifacts.update({"onnx": exported, "serving": str(serving_file)})
        model = Served(exported, how, files.tokenizer_json)
        answer = model.predict(example, params)
        # The model's code is the package's python_model.py; the package travels beside it.
        code, code_paths = onnx_pyfunc.PYTHON_MODEL, [onnx_pyfunc.CODE]
        requirements = _onnx_requirements(bool(files.tokenizer_json), images=model.images)
        # MLflow's signature cannot say "uint8 pixels, floats in [0, 1] or PNG files"; the MLmodel
        # file's metadata says, in words, what the model takes, refuses and returns.
        metadata = {"flyscale_serving": model.describe()}
        inputs = _served_inputs(how["output"])
    else:
        if files.onnx_path:
            log.warning(
                "%s: the objective %r has its own predict() and no serving(), so the registered model is "
                "the PyTorch one, which needs flyscale and the objective's plugin to load",
                name,
                spec.get("objective", {}).get("name"),
            )
        answer = model_io.predict(objective, build(spec, files.weights_path), example, params, context)
        code, code_paths, requirements = mlflow_model.__file__, None, _pip_requirements(bool(files.tokenizer_json))
    signature = infer_signature(example, answer, params)
    if inputs is not None:
        signature.inputs = inputs
    return {
        "python_model": code,
        "code_paths": code_paths,
        "artifacts": artifacts,
        "signature": signature,
        "input_example": (example, params) if params else example,
        "pip_requirements": requirements,
        "metadata": metadata,
    }


def _served_inputs(output: str):
    """The signature's inputs for the ONNX-served model: whatever was sent reaches the model,
    which checks it itself (flyscale/export/onnx_pyfunc/) and refuses in one line.

    A tensor model's is `Tensor('object', (-1,))`, which MLflow (3.17) passes unchanged: a float32
    tensor would turn integer pixels into floats before the model could tell them apart, and
    MLflow's shape check answers with the whole input echoed. It is named (the ONNX file's input,
    Triton's and MLServer's too), because MLflow's JSON parsing takes an empty list for a list of
    records unless the one input has a name, and then refuses it as "an input of type list".
    A language model's is one column of any type: a string column would have MLflow turn a
    number into its text before the model could refuse it."""
    from mlflow.types import ColSpec, Schema, TensorSpec
    from mlflow.types.schema import AnyType

    from flyscale.export.onnx_pyfunc.predictor import INPUT

    if output == "text":
        return Schema([ColSpec(AnyType())])
    return Schema([TensorSpec(np.dtype(object), (-1,), INPUT)])


def _onnx_requirements(tokenizer: bool = False, images: bool = False) -> list[str]:
    """What the served model imports (flyscale/export/onnx_pyfunc/), pinned to what it was checked
    with: onnxruntime; Pillow for an image model, to decode a PNG or JPEG sent to it exactly as
    training decoded its files."""
    named = [f"mlflow=={_version('mlflow')}", f"onnxruntime=={_version('onnxruntime')}", f"numpy=={_version('numpy')}"]
    if images:
        named.append(f"pillow=={_version('pillow')}")
    return [*named, f"tokenizers=={_version('tokenizers')}"] if tokenizer else named
