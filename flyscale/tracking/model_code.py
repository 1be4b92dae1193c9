"""flyscale's models in MLflow, without pickle: a model from code.

MLflow keeps this file as the model's code and artifacts beside it: the weights as a state_dict
(`weights`), what rebuilds the architecture (`spec`: the model plugin and its options, the
dataset info, the objective, and the quantizer that made an int8 model) and, for a language
model, its tokenizer (`tokenizer`). Loading runs this file, builds the model through flyscale's
plugins and loads the weights with `weights_only=True`, so
`mlflow.pyfunc.load_model("models:/flyscale-digits@champion")` works with
MLFLOW_ALLOW_PICKLE_DESERIALIZATION=false. `predict` is the objective's: a classifier's takes
features and returns class probabilities, a regressor's returns values, a language model's takes
prompts (text) and returns their continuations, with `max_new_tokens` and `temperature` as
params. `unwrap_python_model().model` is the torch module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
from mlflow.pyfunc import PythonModel

from flyscale.tracking.model_io import predict
from flyscale.tracking.model_spec import build, objective_of


class FlyscaleModel(PythonModel):
    """A trained flyscale model, served as its objective says."""

    def load_context(self, context) -> None:
        with open(context.artifacts["spec"]) as f:
            spec = json.load(f)
        self.model = build(spec, context.artifacts["weights"])
        tokenizer = context.artifacts.get("tokenizer")
        self.objective, self.context = objective_of(spec, Path(tokenizer).read_text() if tokenizer else "")

    # A type hint MLflow neither validates nor converts (see flyscale/export/onnx_pyfunc/python_model.py): without
    # one, MLflow warns each time this file runs; with it, the signature and the input stay as they were.
    def predict(self, context, model_input: np.ndarray, params: dict | None = None) -> Any:
        return predict(self.objective, self.model, model_input, params, self.context)


mlflow.models.set_model(FlyscaleModel())
