"""The training pipeline. Wiring only: every decision lives in a task or a plugin.

    pyflyte run workflows/train.py training_pipeline                       # local, defaults
    pyflyte run workflows/train.py training_pipeline --cfg configs/x.yaml  # a preset
    pyflyte run --remote workflows/train.py training_pipeline               # on a Flyte cluster

Every cached task also returns a stamp (`*_ran`) of when its body ran; the last task reads them
to say what this execution computed and what it took from the cache.
"""

from flytekit import workflow

from flyscale.config import PipelineConfig
from flyscale.summary import RunSummary
from tasks.data import augment_data, fingerprint_data, load_data, read_reference, split_data, validate_data
from tasks.evaluate import evaluate_model, gate_model, quantize_model
from tasks.preflight import preflight_check
from tasks.register import register_model, summarize
from tasks.train import train_model


@workflow
def training_pipeline(cfg: PipelineConfig = PipelineConfig()) -> RunSummary:
    """fingerprint -> load -> reference -> validate -> split -> augment -> preflight -> train -> evaluate -> gate
    -> quantize -> register -> summarize."""
    fingerprint, started = fingerprint_data(cfg=cfg.data)
    raw, loaded_info, content, load_ran = load_data(cfg=cfg.data, fingerprint=fingerprint)
    reference = read_reference(cfg=cfg.data, store=cfg.mlflow, content=content)
    # `info` as validation held it to the reference (pinned classes); every later stage uses it.
    clean, quarantined, report, info, profile, report_files, validate_ran = validate_data(
        raw=raw, info=loaded_info, cfg=cfg.data, reference=reference
    )
    train, val, test, split_ran = split_data(clean=clean, cfg=cfg.data)
    augmented, augment_ran = augment_data(train=train, info=info, cfg=cfg.augment)
    checked, preflight_ran = preflight_check(
        train=augmented, val=val, info=info, model_cfg=cfg.model, cfg=cfg.train, preflight_cfg=cfg.preflight
    )
    weights, history, train_ran = train_model(
        train=augmented, val=val, info=info, model_cfg=cfg.model, cfg=cfg.train, preflight=checked
    )
    fp32, evaluate_ran = evaluate_model(weights=weights, test=test, info=info, model_cfg=cfg.model)
    judgment = gate_model(metrics=fp32, cfg=cfg.gate, champion_of=cfg.mlflow)
    int8_weights, int8, int8_verdict, quantize_ran = quantize_model(
        weights=weights, test=test, info=info, model_cfg=cfg.model, cfg=cfg.quantize, fp32=fp32
    )
    ran = [load_ran, validate_ran, split_ran, augment_ran, preflight_ran, train_ran, evaluate_ran, quantize_ran]
    summary, register_ran = register_model(
        cfg=cfg, info=info, fingerprint=content, report=report, quarantined=quarantined, profile=profile,
        report_files=report_files, history=history,
        preflight=checked, weights=weights, fp32=fp32, judgment=judgment, int8_weights=int8_weights, int8=int8,
        int8_gate=int8_verdict, runs=ran, started=started,
    )
    return summarize(summary=summary, runs=[*ran, register_ran], started=started)
