"""The register stage as one function of one record: one MLflow run with everything the run's
decisions rested on, both models logged without pickle, versions registered only when every
gate passed, the alias moved by compare-and-set."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from flyscale import settings
from flyscale.config import ModelConfig, PipelineConfig, QuantizeConfig, effective, flatten
from flyscale.data.reference import Profile, reference_json
from flyscale.data.source import DataFingerprint
from flyscale.data.tokenize import TokenStats
from flyscale.data.validation import ValidationReport
from flyscale.evaluate.comparison import Comparison
from flyscale.evaluate.gating import Judgment
from flyscale.evaluate.metrics import EvalMetrics
from flyscale.flyte.provenance import CacheReport, TaskRun, execution_id
from flyscale.plugin.records import DatasetInfo
from flyscale.tracking import log_and_register, model_log, run_log
from flyscale.tracking.descriptions import Describer
from flyscale.tracking.kind import ModelKind
from flyscale.tracking.log_and_register import Registration
from flyscale.tracking.model_spec import spec_json
from flyscale.tracking.store import run_name
from flyscale.train.preflight import PreflightReport
from flyscale.train.telemetry import TrainHistory

ALWAYS_RUN = [
    "check_model",
    "fingerprint_data",
    "read_reference",
    "gate_model",
    "summarize",
]  # never cached: they read live state


def git_commit() -> str:
    """The commit the code came from: FLYSCALE_GIT_COMMIT (set in the image), else the checkout's."""
    if settings.GIT_COMMIT.is_set():
        return settings.GIT_COMMIT.get()
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


@dataclass
class Candidate:
    """Everything a run's decisions rested on, as the register stage has it: the config, what
    validation found, how training went, both models (their files as local paths), their test
    metrics, the gates' judgment, and which tasks of the execution ran."""

    cfg: PipelineConfig
    info: DatasetInfo
    fingerprint: DataFingerprint  # of the data as loaded
    report: ValidationReport
    quarantine_dir: str
    profile: Profile
    report_dir: str  # the validation report's files
    history: TrainHistory
    preflight: PreflightReport
    weights_path: str
    fp32: EvalMetrics
    test_sha256: str
    judgment: Judgment
    int8_weights_path: str  # the int8 ONNX file (int8_format "onnx"), or a torch quantizer's state_dict
    int8: EvalMetrics
    comparison: Comparison
    plots_dir: str
    runs: list[TaskRun]  # every cached task's stamp: which ran now and which came from the cache
    started: TaskRun  # the execution's first stamp
    tokens: TokenStats | None = None  # text: how the documents became token sequences
    tokenizer_json: str = ""  # text: the tokenizer the served model carries
    onnx_path: str = ""  # the fp32 model as ONNX (flyscale/export/onnx.py)
    onnx_sha256: str = ""
    onnx_parity: str = ""  # how the export answered the test split against PyTorch
    int8_format: str = "torch"
    int8_quantizer: str = ""  # the quantizer that made the int8 model, when not the configured one
    onnx_max_abs_diff: float = 0.0
    served_setup: str = ""  # the load test's server ("" = not load-tested)
    served_levels: list[dict] = field(default_factory=list)  # a row per concurrency level
    served_metrics: dict[str, float] = field(default_factory=dict)  # served_c<k>_latency_p99_ms, ...
    served_plots_dir: str = ""
    # The model the weights are of, where training handed on another than cfg.model (LoRA's
    # adapters merged: the same architecture without them); None: cfg.model.
    trained_model: ModelConfig | None = None

    def model(self) -> ModelConfig:
        """What rebuilds the registered weights."""
        return self.trained_model or self.cfg.model


def register(candidate: Candidate, publish: bool) -> Registration:
    """Log the run to MLflow with both models; when `publish` (every gate passed) register them
    and move the alias if the champion is still the one the verdicts were judged against."""
    c, cfg = candidate, candidate.cfg
    limits = cfg.serving.limits()  # what one request may ask of the served model
    fp32 = model_log.ModelFiles(
        c.weights_path, spec_json(c.model(), c.info, None, cfg.objective), c.tokenizer_json, c.onnx_path, limits=limits
    )
    quantizer = cfg.quantize if c.int8_quantizer in ("", cfg.quantize.name) else QuantizeConfig(name=c.int8_quantizer)
    int8_spec = spec_json(c.model(), c.info, quantizer, cfg.objective)
    int8 = (  # an ONNX quantizer's int8 file is served alone; the fp32 weights ride along to fine-tune
        model_log.ModelFiles(c.weights_path, int8_spec, c.tokenizer_json, c.int8_weights_path, limits=limits)
        if c.int8_format == "onnx"
        else model_log.ModelFiles(c.int8_weights_path, int8_spec, c.tokenizer_json)
    )
    name = run_name(cfg.model.name, c.history.strategy, c.history.world_size, c.fingerprint.value, c.started.started_at)
    record = run_record(c)
    return log_and_register.publish(
        record, fp32, int8, cfg.mlflow, name, register=publish, describe=Describer(record, cfg)
    )


def run_record(c: Candidate) -> run_log.RunRecord:
    """What the MLflow run holds: params, metrics, tags, lineage, the quarantine and the reference."""
    cfg, info, fingerprint, history, judgment, comparison = (
        c.cfg,
        c.info,
        c.fingerprint,
        c.history,
        c.judgment,
        c.comparison,
    )
    started, report, fp32 = c.started, judged_report(c.report, judgment), c.fp32
    cache = CacheReport.of(c.runs, started.started_at, ALWAYS_RUN)
    config = effective(cfg)
    config_sha = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    return run_log.RunRecord(
        params=flatten(cfg),
        history=history,
        fp32=fp32,
        int8=c.int8,
        verdicts=judgment.verdicts,
        preflight=c.preflight,
        quarantine_dir=c.quarantine_dir,
        validation=report,
        tags={
            "flyscale.dataset": info.name,
            "flyscale.model": cfg.model.name,
            "flyscale.strategy": history.strategy,
            "flyscale.world_size": str(history.world_size),
            "flyscale.data_fingerprint": fingerprint.value,
            "flyscale.data_fingerprint_method": fingerprint.method,
            "flyscale.test_data": judgment.test_data or "no champion to compare with",
            **({"flyscale.reference_note": judgment.reference_note} if judgment.remeasured else {}),
            "flyscale.resumed_from": resumed(history) or "a fresh start",
            **({"flyscale.int8": f"int8 {comparison.verdict}"} if comparison.verdict else {}),
            **{f"flyscale.cache.{task}": status for task, status in cache.status().items()},
        },
        judged_against=judgment.champion,
        int8_not_registered="" if comparison.pays else f"int8 {comparison.verdict}",
        weights_sha256=fp32.weights_sha256,
        data_sha256=fingerprint.value,
        kind=ModelKind.of(info, cfg.objective.name).to_json(),
        validated_against=c.report.reference,
        reference_json=reference_json(info, c.profile),
        validation_dir=c.report_dir,
        config=config,
        lineage={
            "flyscale.data_fingerprint": fingerprint.value,
            "flyscale.config_sha256": config_sha,
            "flyscale.git_commit": git_commit(),
            "flyscale.flyte_execution": execution_id(),
            "flyscale.image": settings.IMAGE.get() or "unset",
            **({"flyscale.onnx_sha256": c.onnx_sha256} if c.onnx_sha256 else {}),
            # What training started from (model.init_from): a fine-tune's parent version and its weights.
            **({"flyscale.init_from": history.started_from} if history.started_from else {}),
        },
        test_sha256=c.test_sha256,
        metrics={
            **{f"test_{k}": v for k, v in comparison.scalars().items()},
            **({"onnx_max_abs_diff": c.onnx_max_abs_diff} if c.onnx_path else {}),
            **c.served_metrics,
            # The champion's metrics on this run's test split, beside this run's test_*.
            **{f"champion_test_{k}": v for k, v in judgment.champion.scored.items()},
        },
        plots_dir=c.plots_dir,
        tables={
            "latency.json": [*comparison.fp32_latency.table(), *comparison.int8_latency.table()],
            **(
                {"loadtest/levels.json": [{"setup": c.served_setup, **r} for r in c.served_levels]}
                if c.served_levels
                else {}
            ),
        },
        artifact_dirs={"loadtest": c.served_plots_dir} if c.served_plots_dir else {},
        started_at=started.started_at,
        datasets=logged_datasets(cfg, info, fingerprint.value),
        onnx_path=c.onnx_path,
        onnx_parity=c.onnx_parity,
    )


def judged_report(report: ValidationReport, judgment: Judgment) -> ValidationReport:
    """The validation report as the run states it: with drift against the champion the gate
    judged against, where validation had measured it against another reference."""
    if not judgment.remeasured:
        return report
    return dataclasses.replace(report, reference=judgment.reference, drift=dict(judgment.drift))


def logged_datasets(cfg: PipelineConfig, info: DatasetInfo, digest: str) -> list[run_log.LoggedDataset]:
    """The three splits as MLflow's dataset tracking shows them. MLflow keeps one input per name and
    digest, so each split's digest is the data fingerprint's first 12 digits and the split's name."""
    options = cfg.data.options
    path = str(options.get("path", "")) if isinstance(options, dict) else ""
    if info.fields:
        described = {f.name: (f.dtype, list(f.shape)) for f in info.fields}
    else:  # a table's numeric columns reach the model as one features tensor
        described = {"features": ("float32", [len(info.feature_columns)]), info.label_column: ("int64", [])}
    return [
        run_log.LoggedDataset(
            cfg.data.dataset,
            f"{digest[:12]}-{split}",
            path,
            context,
            described,
            "" if path else json.dumps(options, sort_keys=True),
        )
        for split, context in (("train", "training"), ("val", "validation"), ("test", "testing"))
    ]


def resumed(history: TrainHistory) -> str:
    """ "resumed from step 120 (<checkpoint> (local)); 60 of 180 steps computed after it", or ""."""
    if not history.resumed_from:
        return ""
    resharded = f"; {history.resharded}" if history.resharded else ""
    return (
        f"resumed from step {history.resumed_from_step} ({history.resumed_from}); "
        f"{history.steps_run} of {history.steps} steps computed after it{resharded}"
    )
