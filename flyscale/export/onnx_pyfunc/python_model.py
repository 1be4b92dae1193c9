"""The file MLflow keeps as a registered flyscale model's code (`python_model=`, a model from code):
the MLflow model, which answers a request with `predictor.Served` and says every failure in one
line.

MLflow runs this file without a package, where it is logged (inside flyscale) and where it is
served (from the model's folder, with `code/`, this package's copy, on sys.path: `code_paths`).
So it finds its siblings by name: the copy that travels with the model first, flyscale's where
there is none (when logging). See __init__.py for what they may import.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any

import mlflow
import numpy as np
from mlflow.pyfunc import PythonModel

log = logging.getLogger(__name__)


def _own(name: str) -> ModuleType:
    """This package's module `name`: the model's own copy, else flyscale's."""
    try:
        return importlib.import_module(f"onnx_pyfunc.{name}")
    except ModuleNotFoundError as exc:
        if exc.name not in ("onnx_pyfunc", f"onnx_pyfunc.{name}"):
            raise
        return importlib.import_module(f"flyscale.export.onnx_pyfunc.{name}")


errors, predictor = _own("errors"), _own("predictor")


class OnnxModel(PythonModel):
    """A flyscale model served by ONNX Runtime."""

    def load_context(self, context) -> None:
        a = context.artifacts
        # A program (.pt2, from an older flyscale) is refused.
        self.served = predictor.load(a.get("onnx") or a["program"], a["serving"], a.get("tokenizer"))

    # Without a type hint on predict, MLflow warns each time this file runs (logging, validating,
    # every load). An ndarray is a type MLflow neither validates nor converts, so the logged
    # signature and what predict receives stay as they were: {"input": array} from the named
    # tensor signature, a DataFrame of prompts from a language model's. A union would warn too
    # (MLflow 3.17 takes none here).
    def predict(self, context, model_input: np.ndarray, params: dict | None = None) -> Any:
        try:
            return self.served.predict(model_input, params)
        except errors.OneLine:
            raise
        except Exception as exc:  # a failure of the model's own: one line to the caller, the trace to the log
            log.exception("the model failed on a request")
            raise errors.OneLine(
                f"the model failed on this request ({type(exc).__name__}); the server's log has why"
            ) from None


mlflow.models.set_model(OnnxModel())
