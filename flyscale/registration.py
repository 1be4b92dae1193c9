"""The register stage as one function: one MLflow run with everything the run's decisions
rested on, both models logged without pickle, versions registered only when every gate passed,
the alias moved by compare-and-set. The tasks that call it only unpack Flyte's inputs."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import numpy as np

from flyscale import tracking
from flyscale.comparison import Comparison
from flyscale.config import PipelineConfig, effective, flatten
from flyscale.contracts import DatasetInfo
from flyscale.data import DataFingerprint
from flyscale.evaluation import EvalMetrics
from flyscale.gating import Judgment
from flyscale.model_spec import spec_json
from flyscale.preflight import PreflightReport
from flyscale.provenance import CacheReport, TaskRun, execution_id
from flyscale.summary import RunSummary
from flyscale.training import TrainHistory
from flyscale.validation import Profile, ValidationReport, reference_json

ALWAYS_RUN = ["fingerprint_data", "read_reference", "gate_model", "summarize"]  # never cached: they read live state


def git_commit() -> str:
    """The commit the code came from: FLYSCALE_GIT_COMMIT (set in the image), else the checkout's."""
    if os.environ.get("FLYSCALE_GIT_COMMIT"):
        return os.environ["FLYSCALE_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def register(
    cfg: PipelineConfig, info: DatasetInfo, fingerprint: DataFingerprint, report: ValidationReport,
    quarantine_dir: str, profile: Profile, report_dir: str, history: TrainHistory, preflight: PreflightReport,
    weights_path: str, fp32: EvalMetrics, test_sha256: str, judgment: Judgment, int8_weights_path: str,
    int8: EvalMetrics, comparison: Comparison, plots_dir: str, runs: list[TaskRun], started: TaskRun, publish: bool,
) -> RunSummary:
    """Log the run to MLflow with both models; when `publish` (every gate passed) register them
    and move the alias if the champion is still the one the verdicts were judged against."""
    cache = CacheReport.of(runs, started.started_at, ALWAYS_RUN)
    config = effective(cfg)
    config_sha = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    record = tracking.RunRecord(
        params=flatten(cfg),
        history=history,
        fp32=fp32,
        int8=int8,
        verdicts=judgment.verdicts,
        preflight=preflight,
        quarantine_dir=quarantine_dir,
        validation=report,
        tags={
            "flyscale.dataset": info.name,
            "flyscale.model": cfg.model.name,
            "flyscale.strategy": history.strategy,
            "flyscale.world_size": str(history.world_size),
            "flyscale.data_fingerprint": fingerprint.value,
            "flyscale.data_fingerprint_method": fingerprint.method,
            "flyscale.test_data": judgment.test_data or "no champion to compare with",
            "flyscale.resumed_from": _resumed(history) or "a fresh start",
            **{f"flyscale.cache.{task}": status for task, status in cache.status().items()},
        },
        judged_against=judgment.champion,
        weights_sha256=fp32.weights_sha256,
        data_sha256=fingerprint.value,
        reference_json=reference_json(info, profile),
        validation_dir=report_dir,
        config=config,
        lineage={
            "flyscale.data_fingerprint": fingerprint.value,
            "flyscale.config_sha256": config_sha,
            "flyscale.git_commit": git_commit(),
            "flyscale.flyte_execution": execution_id(),
            "flyscale.image": os.environ.get("FLYSCALE_IMAGE", "") or "unset",
        },
        test_sha256=test_sha256,
        metrics={f"test_{k}": v for k, v in comparison.scalars().items()},
        plots_dir=plots_dir,
        tables={"latency.json": [*comparison.fp32_latency.table(), *comparison.int8_latency.table()]},
        started_at=started.started_at,
    )
    example = np.zeros((2, len(info.feature_columns)), dtype="float32")
    name = tracking.run_name(cfg.model.name, history.strategy, history.world_size, fingerprint.value, started.started_at)
    registration = tracking.publish(
        record,
        tracking.ModelFiles(weights_path, spec_json(cfg.model, info, None)),
        tracking.ModelFiles(int8_weights_path, spec_json(cfg.model, info, cfg.quantize)),
        example, cfg.mlflow, name, register=publish,
    )
    return RunSummary(
        validation=report, fp32=fp32, int8=int8, verdicts=judgment.verdicts, registration=registration,
        preflight=preflight, fingerprint=fingerprint, comparison=comparison, test_data=judgment.test_data,
        resumed=_resumed(history), diagnosis=history.diagnosis,
    )


def _resumed(history: TrainHistory) -> str:
    """"resumed from step 120 (<checkpoint> (local)); 60 of 180 steps computed after it", or ""."""
    if not history.resumed_from:
        return ""
    return (f"resumed from step {history.resumed_from_step} ({history.resumed_from}); "
            f"{history.steps_run} of {history.steps} steps computed after it")
