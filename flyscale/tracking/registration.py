"""The register stage as one function of one record: one MLflow run with everything the run's
decisions rested on, both models logged without pickle, versions registered only when every
gate passed, the alias moved by compare-and-set."""

from __future__ import annotations

import hashlib
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from flyscale import settings
from flyscale.config import PipelineConfig, effective, flatten
from flyscale.data.reference import Profile, reference_json
from flyscale.data.source import DataFingerprint
from flyscale.data.tokenize import TokenStats
from flyscale.data.validation import ValidationReport
from flyscale.evaluate.comparison import Comparison
from flyscale.evaluate.gating import Judgment
from flyscale.evaluate.metrics import EvalMetrics
from flyscale.flyte.provenance import CacheReport, TaskRun, execution_id
from flyscale.plugin.contracts import DatasetInfo
from flyscale.tracking import publish as tracking
from flyscale.tracking import run_log
from flyscale.tracking.model_spec import spec_json
from flyscale.tracking.publish import Registration
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
    int8_weights_path: str
    int8: EvalMetrics
    comparison: Comparison
    plots_dir: str
    runs: list[TaskRun]  # every cached task's stamp: which ran now and which came from the cache
    started: TaskRun  # the execution's first stamp
    tokens: TokenStats | None = None  # text: how the documents became token sequences
    tokenizer_json: str = ""  # text: the tokenizer the served model carries


def register(candidate: Candidate, publish: bool) -> Registration:
    """Log the run to MLflow with both models; when `publish` (every gate passed) register them
    and move the alias if the champion is still the one the verdicts were judged against."""
    c, cfg = candidate, candidate.cfg
    fp32 = run_log.ModelFiles(c.weights_path, spec_json(cfg.model, c.info, None, cfg.objective), c.tokenizer_json)
    int8 = run_log.ModelFiles(
        c.int8_weights_path, spec_json(cfg.model, c.info, cfg.quantize, cfg.objective), c.tokenizer_json
    )
    name = run_name(cfg.model.name, c.history.strategy, c.history.world_size, c.fingerprint.value, c.started.started_at)
    return tracking.publish(run_record(c), fp32, int8, cfg.mlflow, name, register=publish)


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
    started, report, fp32 = c.started, c.report, c.fp32
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
            "flyscale.resumed_from": resumed(history) or "a fresh start",
            **{f"flyscale.cache.{task}": status for task, status in cache.status().items()},
        },
        judged_against=judgment.champion,
        weights_sha256=fp32.weights_sha256,
        data_sha256=fingerprint.value,
        reference_json=reference_json(info, c.profile),
        validation_dir=c.report_dir,
        config=config,
        lineage={
            "flyscale.data_fingerprint": fingerprint.value,
            "flyscale.config_sha256": config_sha,
            "flyscale.git_commit": git_commit(),
            "flyscale.flyte_execution": execution_id(),
            "flyscale.image": settings.IMAGE.get() or "unset",
        },
        test_sha256=c.test_sha256,
        metrics={f"test_{k}": v for k, v in comparison.scalars().items()},
        plots_dir=c.plots_dir,
        tables={"latency.json": [*comparison.fp32_latency.table(), *comparison.int8_latency.table()]},
        started_at=started.started_at,
        datasets=logged_datasets(cfg, info, fingerprint.value),
    )


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
