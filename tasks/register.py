"""Registration stage: one MLflow run per pipeline execution, both models, the champion alias."""

from __future__ import annotations

import flytekit
import torch
from flytekit import task
from flytekit.types.file import FlyteFile
from pandera.typing import DataFrame

from flyscale import artifacts, tracking
from flyscale.caching import code_cache
from flyscale.config import PipelineConfig, flatten
from flyscale.contracts import DatasetInfo, GateVerdict
from flyscale.data import ValidationReport
from flyscale.evaluation import EvalMetrics
from flyscale.preflight import PreflightReport
from flyscale.schemas import QuarantineFrame
from flyscale.summary import RunSummary
from flyscale.training import TrainHistory
from tasks.common import IMAGE, SMALL


# The MLflow store is part of the cache key: the same inputs sent to another store must register again.
@task(cache=code_cache("models", "quantizers", extra=tracking.tracking_uri), container_image=IMAGE, requests=SMALL)
def register_model(
    cfg: PipelineConfig,
    info: DatasetInfo,
    report: ValidationReport,
    quarantined: DataFrame[QuarantineFrame],
    history: TrainHistory,
    weights: FlyteFile,
    fp32: EvalMetrics,
    gate: GateVerdict,
    int8_weights: FlyteFile,
    int8: EvalMetrics,
    int8_gate: GateVerdict,
    preflight: PreflightReport,
) -> RunSummary:
    """Log everything to MLflow; move the alias only if every gate passed."""
    model = artifacts.load_state(artifacts.build_model(cfg.model, info), weights.download())
    qmodel = artifacts.load_state(artifacts.quantize(artifacts.build_model(cfg.model, info), cfg.quantize), int8_weights.download())
    execution = flytekit.current_context().execution_id.name
    record = tracking.RunRecord(
        params=flatten(cfg),
        history=history,
        fp32=fp32,
        int8=int8,
        verdicts=[gate, int8_gate],
        preflight=preflight,
        quarantined=quarantined,
        validation={"total_rows": report.total_rows, "valid_rows": report.valid_rows, "quarantined_rows": report.quarantined_rows},
        tags={
            "flyscale.execution_id": execution,
            "flyscale.dataset": info.name,
            "flyscale.model": cfg.model.name,
            "flyscale.strategy": history.strategy,
            "flyscale.world_size": str(history.world_size),
        },
    )
    example = torch.zeros(2, len(info.feature_columns))
    registration = tracking.publish(
        record, model, qmodel, example, cfg.mlflow.experiment, cfg.mlflow.model_name, cfg.mlflow.alias,
        run_name=f"{cfg.model.name}-{history.strategy}-{execution}",
    )
    return RunSummary(
        validation=report, fp32=fp32, int8=int8, verdicts=[gate, int8_gate], registration=registration, preflight=preflight
    )
