"""One trained model as flyscale logs it to MLflow, pickle-free (`ModelFiles`): its weights and
what rebuilds them, served by ONNX Runtime alone where its objective says how, else as a PyTorch
model that needs flyscale; with the signature, input example and pinned requirements MLflow
records. The run that holds it is run_log.py's; registering versions is `publish`'s.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from flyscale.tracking.store import quiet_artifacts

log = logging.getLogger(__name__)


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


def link_metrics(client, run_id: str, metrics: list, model_ids: list[str]) -> None:
    """Give each logged model of the run a copy of `metrics` (MLflow Metrics: the run's step-0
    metrics, logged after the models), as MLflow's log_model does for those already in the run:
    the logged model's page and the Models tab show them. The copy keeps the metric's timestamp,
    so the run's history holds it once, as MLflow's own copy does.

    log_model reads back the whole history of every metric already in the run, one request a
    metric and a model (about 200 for a run's 100 metrics and its two models, each a round trip to
    the tracking server), so the run logs its models first, then its metrics, and links them
    here: one request a model."""
    from mlflow.entities import Metric

    for model_id in model_ids:
        copies = [Metric(m.key, m.value, m.timestamp, m.step, model_id=model_id) for m in metrics]
        client.log_batch(run_id, metrics=copies)


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

    from flyscale.data import text as text_tokenizers
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
    if as_safetensors(files.weights_path, Path(tmp) / f"{name}_model.safetensors"):
        artifacts["weights_safetensors"] = str(Path(tmp) / f"{name}_model.safetensors")
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
        # A classifier of text takes documents too, and tokenizes them as training did.
        if files.tokenizer_json and how["output"] != "text":
            pad = text_tokenizers.from_json(files.tokenizer_json).pad
            how["input"]["text"] = {"seq_len": model_input_shape(context.info)[0], "pad": pad}
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


def as_safetensors(weights_path: str, out: Path) -> bool:
    """The state_dict at `weights_path` written to `out` as safetensors, the format the Hugging Face
    ecosystem loads (every key, as `load_state_dict` wants it: a tied weight is stored under each of
    its names). False, with the reason logged, for a state_dict safetensors cannot hold: a torch.ao
    int8 model's packed parameters."""
    from flyscale.export.huggingface import save_tensors

    state = torch.load(weights_path, map_location="cpu", weights_only=True)
    odd = [k for k, v in state.items() if not isinstance(v, torch.Tensor) or v.is_quantized]
    if odd:
        log.info("weights not written as safetensors: %s holds packed or quantized values (%s)", weights_path, odd[0])
        return False
    save_tensors(state, out)
    return True


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


def _pip_requirements(tokenizer: bool = False) -> list[str]:
    # Naming them skips MLflow's slow requirement inference; the +cpu label is not on PyPI.
    named = [f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={_version('mlflow')}"]
    return [*named, f"tokenizers=={_version('tokenizers')}"] if tokenizer else named


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)
