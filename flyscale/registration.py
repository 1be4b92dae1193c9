"""The register stage as one function: both models rebuilt from their weights, one MLflow run
with everything the run's decisions rested on, versions registered, the alias moved by
compare-and-set. The task that calls it only unpacks Flyte's inputs."""

from __future__ import annotations

import torch

from flyscale import artifacts, tracking
from flyscale.config import PipelineConfig, flatten
from flyscale.contracts import DatasetInfo, GateVerdict
from flyscale.data import DataFingerprint
from flyscale.evaluation import EvalMetrics
from flyscale.gating import Judgment
from flyscale.preflight import PreflightReport
from flyscale.provenance import CacheReport, TaskRun
from flyscale.summary import RunSummary
from flyscale.training import TrainHistory
from flyscale.validation import Profile, ValidationReport, reference_json

ALWAYS_RUN = ["fingerprint_data", "read_reference", "gate_model", "summarize"]  # never cached: they read live state


def register(
    cfg: PipelineConfig, info: DatasetInfo, fingerprint: DataFingerprint, report: ValidationReport,
    quarantine_dir: str, profile: Profile, report_dir: str, history: TrainHistory, preflight: PreflightReport,
    weights_path: str, fp32: EvalMetrics,
    judgment: Judgment, int8_weights_path: str, int8: EvalMetrics, int8_gate: GateVerdict,
    runs: list[TaskRun], started: TaskRun,
) -> RunSummary:
    """Log the run to MLflow and register both models; the alias moves only if every gate passed
    and the champion is still the one the verdict was judged against."""
    model = artifacts.load_state(artifacts.build_model(cfg.model, info), weights_path)
    quantized = artifacts.quantize(artifacts.build_model(cfg.model, info), cfg.quantize)
    qmodel = artifacts.load_state(quantized, int8_weights_path)
    verdicts = [judgment.verdict, int8_gate]
    cache = CacheReport.of(runs, started.started_at, ALWAYS_RUN)
    record = tracking.RunRecord(
        params=flatten(cfg),
        history=history,
        fp32=fp32,
        int8=int8,
        verdicts=verdicts,
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
            **{f"flyscale.cache.{task}": status for task, status in cache.status().items()},
        },
        judged_against=judgment.champion,
        weights_sha256=fp32.weights_sha256,
        data_sha256=fingerprint.value,
        reference_json=reference_json(info, profile),
        validation_dir=report_dir,
    )
    example = torch.zeros(2, len(info.feature_columns))
    registration = tracking.publish(record, model, qmodel, example, cfg.mlflow, run_name=f"{cfg.model.name}-{history.strategy}")
    return RunSummary(
        validation=report, fp32=fp32, int8=int8, verdicts=verdicts, registration=registration, preflight=preflight,
        fingerprint=fingerprint,
    )
