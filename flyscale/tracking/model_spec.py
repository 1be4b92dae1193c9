"""What rebuilds a flyscale model from its weights: the model plugin and its options, the
dataset info, the objective (what the served model takes and returns), and the quantizer that
made an int8 model. Stored as JSON beside the state_dict in MLflow
(flyscale/tracking/model_code.py), so no model is ever pickled. A language model's tokenizer is
an artifact of its own beside them."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from torch import nn

from flyscale import model as artifacts
from flyscale.config import ModelConfig, ObjectiveConfig, QuantizeConfig
from flyscale.evaluate.quantize import rebuild_quantized
from flyscale.plugin.records import DatasetInfo, ObjectiveContext, as_dataset_info


def spec_json(
    model_cfg: ModelConfig,
    info: DatasetInfo,
    quantize_cfg: QuantizeConfig | None,
    objective_cfg: ObjectiveConfig | None = None,
) -> str:
    """What rebuilds the architecture: plain JSON, written by the register task."""
    objective = objective_cfg or ObjectiveConfig()
    r = model_cfg.plugin
    portable = r.method("portable")  # options that rebuild the model without the files it came from
    options = asdict(portable(r.options)) if portable is not None else model_cfg.options
    return json.dumps(
        {
            "model": {"name": model_cfg.name, "options": options},
            "info": asdict(info),
            "objective": {"name": objective.name, "options": objective.options},
            "quantizer": None if quantize_cfg is None else {"name": quantize_cfg.name, "options": quantize_cfg.options},
        },
        sort_keys=True,
    )


def build(spec: dict, weights_path: str) -> nn.Module:
    """The torch module a spec and its weights describe (int8 when the spec names a quantizer)."""
    info = as_dataset_info(spec["info"], "the registered model's spec")
    model = artifacts.build_model(ModelConfig(**spec["model"]), info)
    if spec.get("quantizer"):
        model = rebuild_quantized(model, QuantizeConfig(**spec["quantizer"]), info)
    return artifacts.load_state(model, weights_path)


def objective_of(spec: dict, tokenizer_json: str = "") -> tuple[Any, ObjectiveContext]:
    """The spec's objective, configured, and its context (a model registered before objectives
    existed is a classifier)."""
    from flyscale.train.objective import of

    given = spec.get("objective") or {"name": "classification", "options": {}}
    info = as_dataset_info(spec["info"], "the registered model's spec")
    return of(ObjectiveConfig(**given)), ObjectiveContext(info, tokenizer_json=tokenizer_json)


def artifact_files(model_dir: Path) -> dict[str, Path]:
    """The files a downloaded MLflow model carries as its pyfunc artifacts (weights, spec,
    tokenizer, onnx, serving ...), by name, as its MLmodel lists them; empty for a model with none."""
    import yaml

    flavor = yaml.safe_load((model_dir / "MLmodel").read_text())["flavors"].get("python_function", {})
    return {name: model_dir / a["path"] for name, a in (flavor.get("artifacts") or {}).items()}
