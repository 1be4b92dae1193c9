"""What a registered model takes and returns: its objective's, where the objective says
(`predict`, `example`), else the model's raw outputs for float32 inputs of the declared shape."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from flyscale.data import fields
from flyscale.plugin.records import ObjectiveContext


def predict(objective: Any, model: nn.Module, model_input: Any, params: dict | None, context: ObjectiveContext) -> Any:
    """The served model's answer to `model_input` (and `params`, MLflow's inference params)."""
    own = getattr(objective, "predict", None)
    if own is not None:
        return own(model, model_input, dict(params or {}), context)
    x = torch.as_tensor(np.asarray(model_input, dtype="float32"))
    model.eval()
    with torch.inference_mode():
        return model(x).numpy()


def example(objective: Any, context: ObjectiveContext) -> tuple[Any, dict | None]:
    """(an input example, the inference params with their defaults, or None): what the served
    model's signature is inferred from and what MLflow shows beside it."""
    own = getattr(objective, "example", None)
    if own is not None:
        made, params = own(context)
        return made, (dict(params) if params else None)
    return fields.input_example(context.info), None
