"""A flyscale model registered straight into a tracking store, as the register task logs it
(ONNX-served, weights and spec beside it): for tests whose subject is what comes after
registration (servers, batch prediction), without a pipeline run to get there."""

from __future__ import annotations

import os
from pathlib import Path

import mlflow
import torch
from mlflow import MlflowClient

from flyscale.api import DatasetInfo
from flyscale.config import ModelConfig, ObjectiveConfig
from flyscale.data import fields
from flyscale.export import onnx
from flyscale.model import build_model, save_state
from flyscale.tracking import model_log
from flyscale.tracking.model_spec import spec_json

DIGITS = DatasetInfo("digits", 10, [64], [f"pixel_{i}" for i in range(64)])


def register(
    home: Path,
    name: str,
    info: DatasetInfo = DIGITS,
    model_cfg: ModelConfig | None = None,
    objective_cfg: ObjectiveConfig | None = None,
    tokenizer_json: str = "",
    limits: dict | None = None,
) -> str:
    """`name` v1 (alias champion) in a SQLite store under `home`, its artifacts beside it; the URI.
    A language model (`objective_cfg` language_modeling) needs its tokenizer's JSON. `limits`:
    what one request may ask (ServingConfig's fields), the defaults otherwise."""
    uri = f"sqlite:///{home / 'mlflow.db'}"
    model_cfg = model_cfg or ModelConfig()
    torch.manual_seed(0)
    model = build_model(model_cfg, info).eval()
    shape = fields.model_input_shape(info)
    if tokenizer_json:  # token ids, the model reading all but the last of a sequence
        example = torch.randint(0, info.input().range[1], (4, shape[0] - 1))
    else:
        example = torch.rand(4, *shape)
    path = onnx.export(model, example, home / "model.onnx")
    spec = spec_json(model_cfg, info, None, objective_cfg)
    files = model_log.ModelFiles(save_state(model, "m.pt"), spec, tokenizer_json, str(path), limits=limits or {})
    cwd = Path.cwd()
    os.chdir(home)  # the experiment's artifacts land beside the store
    try:
        mlflow.set_tracking_uri(uri)
        # This store's own experiment: the process may have an active one of another store.
        experiment = mlflow.set_experiment(f"{name}-tests")
        with mlflow.start_run(experiment_id=experiment.experiment_id):
            logged = model_log.log_model(files, "model", str(home))
        version = mlflow.register_model(logged.model_uri, name)
        MlflowClient(uri).set_registered_model_alias(name, "champion", version.version)
    finally:
        os.chdir(cwd)
    return uri
