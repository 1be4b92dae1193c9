"""flyscale's models in MLflow, without pickle: a model from code.

MLflow keeps this file as the model's code and two artifacts beside it: the weights as a
state_dict (`weights`) and what rebuilds the architecture (`spec`: the model plugin and its
options, the dataset info, and the quantizer that made an int8 model). Loading runs this file,
builds the model through flyscale's plugins and loads the weights with `weights_only=True`, so
`mlflow.pyfunc.load_model("models:/flyscale-digits@champion")` works with
MLFLOW_ALLOW_PICKLE_DESERIALIZATION=false. `predict` takes features (rows x features, float32)
and returns class probabilities; `unwrap_python_model().model` is the torch module.
"""

from __future__ import annotations

import json

import mlflow
import numpy as np
from mlflow.pyfunc import PythonModel

from flyscale.tracking.model_spec import build


class FlyscaleModel(PythonModel):
    """A trained flyscale classifier: features in, class probabilities out."""

    def load_context(self, context) -> None:
        with open(context.artifacts["spec"]) as f:
            self.model = build(json.load(f), context.artifacts["weights"])

    def predict(self, context, model_input: np.ndarray, params=None) -> np.ndarray:
        import torch

        x = torch.as_tensor(np.asarray(model_input, dtype="float32"))
        with torch.inference_mode():
            return torch.softmax(self.model(x), dim=1).numpy()


mlflow.models.set_model(FlyscaleModel())
