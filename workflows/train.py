"""The training pipeline. Wiring only: every decision lives in a task or a plugin.

    pyflyte run workflows/train.py training_pipeline                       # local, defaults
    pyflyte run workflows/train.py training_pipeline --cfg configs/x.yaml  # a preset
    pyflyte run --remote workflows/train.py training_pipeline               # on a Flyte cluster
"""

from flytekit import workflow

from flyscale.config import PipelineConfig
from flyscale.summary import RunSummary
from tasks.data import augment_data, load_data, split_data, validate_data
from tasks.evaluate import evaluate_model, gate_model, quantize_model
from tasks.preflight import preflight_check
from tasks.register import register_model
from tasks.train import train_model


@workflow
def training_pipeline(cfg: PipelineConfig = PipelineConfig()) -> RunSummary:
    """load -> validate -> split -> augment -> preflight -> train -> evaluate -> gate -> quantize -> register."""
    raw, info = load_data(cfg=cfg.data)
    clean, quarantined, report = validate_data(raw=raw, info=info, cfg=cfg.data)
    train, val, test = split_data(clean=clean, cfg=cfg.data)
    augmented = augment_data(train=train, info=info, cfg=cfg.augment)
    checked = preflight_check(
        train=augmented, val=val, info=info, model_cfg=cfg.model, cfg=cfg.train, preflight_cfg=cfg.preflight
    )
    weights, history = train_model(
        train=augmented, val=val, info=info, model_cfg=cfg.model, cfg=cfg.train, preflight=checked
    )
    fp32 = evaluate_model(weights=weights, test=test, info=info, model_cfg=cfg.model)
    verdict = gate_model(metrics=fp32, cfg=cfg.gate, champion_of=cfg.mlflow)
    int8_weights, int8, int8_verdict = quantize_model(
        weights=weights, test=test, info=info, model_cfg=cfg.model, cfg=cfg.quantize, fp32=fp32
    )
    return register_model(
        cfg=cfg, info=info, report=report, quarantined=quarantined, history=history, preflight=checked,
        weights=weights, fp32=fp32, gate=verdict, int8_weights=int8_weights, int8=int8, int8_gate=int8_verdict,
    )
