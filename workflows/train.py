"""The training pipeline. Wiring only: every decision lives in a task or a plugin.

    pyflyte run workflows/train.py training_pipeline                       # local, defaults
    pyflyte run workflows/train.py training_pipeline --cfg configs/x.yaml  # a preset
    pyflyte run --remote workflows/train.py training_pipeline               # on a Flyte cluster

Each stage hands the next a typed record (tasks/records.py); a stage that needs one field of it
gets that field (`validated.info`). Training hands on the model as one bundle, which evaluation,
export, quantization, the load test and registration each take whole. Every cached task also returns a stamp (`*_ran`) of when its
body ran; the last task reads them to say what this execution computed and what it took from the
cache.
"""

from flytekit import conditional, workflow

from flyscale.config import PipelineConfig
from flyscale.render.summary import RunSummary
from tasks.data import fingerprint_data
from tasks.evaluate import evaluate_model, gate_model, quantize_model
from tasks.export import export_model
from tasks.loadtest import load_test_model
from tasks.preflight import check_model, preflight_check
from tasks.register import close_failed_run, record_candidate, register_model, summarize
from tasks.train import train_model
from workflows.data import dataset


# A task that fails leaves the execution's MLflow run FAILED, not RUNNING for ever.
@workflow(on_failure=close_failed_run)
def training_pipeline(cfg: PipelineConfig = PipelineConfig()) -> RunSummary:  # noqa: B008 (a Flyte input's default)
    """check the model -> fingerprint -> data (a table in memory or streamed, typed examples, or text) -> preflight -> train -> evaluate -> export (ONNX) -> quantize (the
    ONNX file, by default) -> load test of the served model (serving.loadtest) -> gate -> register (every gate passed) or record (one failed) -> summarize."""
    model_check = check_model(
        data_cfg=cfg.data,
        model_cfg=cfg.model,
        cfg=cfg.train,
        objective=cfg.objective,
        tokenize=cfg.tokenize,
        mlflow_cfg=cfg.mlflow,
    )
    fingerprint, kind, tokenizer, started = fingerprint_data(cfg=cfg.data, tokenize=cfg.tokenize, model=model_check)
    train, val, test, validated, data_ran = dataset(cfg=cfg, fingerprint=fingerprint, kind=kind, tokenizer=tokenizer)
    preflight, preflight_ran = preflight_check(
        train=train,
        val=val,
        info=validated.info,
        model_cfg=cfg.model,
        cfg=cfg.train,
        preflight_cfg=cfg.preflight,
        objective=cfg.objective,
    )
    model, history, train_ran = train_model(
        train=train,
        val=val,
        info=validated.info,
        model_cfg=cfg.model,
        cfg=cfg.train,
        preflight=preflight,
        fingerprint=validated.content,
        started=started,
        mlflow_cfg=cfg.mlflow,
        recovery=cfg.recovery,
        augment=cfg.augment,
        objective=cfg.objective,
        start=model_check.start,
        start_sha256=model_check.start.sha256,
        workers=preflight.workers,
        tokenizer=validated.tokenizer,
        tokenizer_sha256=validated.tokenizer_sha256,
    )
    # `model` is the trained model's bundle (weights, model config, info, objective, tokenizer),
    # keyed by content. Text: the tokens' bytes give bits per byte. (Not all of `validated`: its
    # report changes with the champion, which would re-run evaluation.)
    fp32, evaluate_ran = evaluate_model(model=model, test=test, tokens=validated.tokens)
    exported, export_ran = export_model(model=model, test=test, export=cfg.export)
    # A file taken out of a record enters a cache key by the sha256 beside it (tasks/records.py).
    int8, quantize_ran = quantize_model(
        model=model,
        train=train,
        test=test,
        cfg=cfg.quantize,
        fp32=fp32.metrics,
        history=history,
        onnx_model=exported.onnx,
        onnx_sha256=exported.sha256,
        tokens=validated.tokens,
    )
    served, served_ran = load_test_model(exported=exported, model=model, cfg=cfg.serving)
    # The champion is scored on this run's test split for a gate that compares with it, and drift
    # is measured against it (the validation's may have been against another: from the cache).
    judgment, passed = gate_model(
        fp32=fp32,
        int8=int8,
        exported=exported,
        served=served,
        cfg=cfg.gate,
        champion_of=cfg.mlflow,
        test=test,
        validated=validated,
        objective=cfg.objective,
    )
    ran = [preflight_ran, train_ran, evaluate_ran, export_ran, quantize_ran, served_ran]
    candidate = dict(
        cfg=cfg,
        validated=validated,
        preflight=preflight,
        model=model,
        history=history,
        fp32=fp32,
        int8=int8,
        exported=exported,
        served=served,
        judgment=judgment,
        runs=ran,
        data_runs=data_ran,
        started=started,
    )
    # The graph shows which ran: a passing candidate is registered, a failed one only logged.
    summary, register_ran = (
        conditional("publish")
        .if_(passed.is_true())
        .then(register_model(**candidate))
        .else_()
        .then(record_candidate(**candidate))
    )
    return summarize(summary=summary, runs=ran, data_runs=data_ran, register_run=register_ran, started=started)
