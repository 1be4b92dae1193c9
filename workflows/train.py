"""The training pipeline. Wiring only: every decision lives in a task or a plugin.

    pyflyte run workflows/train.py training_pipeline                       # local, defaults
    pyflyte run workflows/train.py training_pipeline --cfg configs/x.yaml  # a preset
    pyflyte run --remote workflows/train.py training_pipeline               # on a Flyte cluster

Every cached task also returns a stamp (`*_ran`) of when its body ran; the last task reads them
to say what this execution computed and what it took from the cache.
"""

from flytekit import conditional, workflow

from flyscale.config import PipelineConfig
from flyscale.summary import RunSummary
from tasks.data import fingerprint_data
from tasks.evaluate import evaluate_model, gate_model, quantize_model
from tasks.preflight import preflight_check
from tasks.register import close_failed_run, record_candidate, register_model, summarize
from tasks.train import train_model
from workflows.data import in_memory_data, streamed_data


# A task that fails leaves the execution's MLflow run FAILED, not RUNNING for ever.
@workflow(on_failure=close_failed_run)
def training_pipeline(cfg: PipelineConfig = PipelineConfig()) -> RunSummary:
    """fingerprint -> data (in memory, or streamed) -> preflight -> train -> evaluate -> quantize
    -> gate -> register (every gate passed) or record (one failed) -> summarize."""
    fingerprint, streaming, started = fingerprint_data(cfg=cfg.data)
    train, val, test, quarantined, report, info, profile, report_files, content, data_ran = (
        conditional("data")
        .if_(streaming.is_true())
        .then(streamed_data(cfg=cfg, fingerprint=fingerprint))
        .else_()
        .then(in_memory_data(cfg=cfg, fingerprint=fingerprint))
    )
    preflight_report, preflight_ran = preflight_check(
        train=train, val=val, info=info, model_cfg=cfg.model, cfg=cfg.train, preflight_cfg=cfg.preflight
    )
    weights, history, train_ran = train_model(
        train=train, val=val, info=info, model_cfg=cfg.model, cfg=cfg.train, preflight=preflight_report,
        fingerprint=content, started=started, mlflow_cfg=cfg.mlflow, recovery=cfg.recovery,
    )
    fp32, test_sha256, evaluate_ran = evaluate_model(weights=weights, test=test, info=info, model_cfg=cfg.model)
    int8_weights, int8, comparison, figures, quantize_ran = quantize_model(
        weights=weights, train=train, test=test, info=info, model_cfg=cfg.model, cfg=cfg.quantize, fp32=fp32,
        history=history,
    )
    judgment, passed = gate_model(
        fp32=fp32, int8=int8, comparison=comparison, test_sha256=test_sha256, cfg=cfg.gate, champion_of=cfg.mlflow
    )
    ran = [preflight_ran, train_ran, evaluate_ran, quantize_ran]
    logged = dict(
        cfg=cfg, info=info, fingerprint=content, report=report, quarantined=quarantined, profile=profile,
        report_files=report_files, history=history, preflight=preflight_report, weights=weights, fp32=fp32,
        test_sha256=test_sha256, judgment=judgment, int8_weights=int8_weights, int8=int8, comparison=comparison,
        plots=figures, runs=ran, data_runs=data_ran, started=started,
    )
    # The graph shows which ran: a passing candidate is registered, a failed one only logged.
    summary, register_ran = (
        conditional("publish")
        .if_(passed.is_true())
        .then(register_model(**logged))
        .else_()
        .then(record_candidate(**logged))
    )
    return summarize(summary=summary, runs=ran, data_runs=data_ran, register_run=register_ran, started=started)
